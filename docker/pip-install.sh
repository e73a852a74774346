#!/bin/sh
# Runs one command (a pip install) inside an image build with the optional build-time inputs, none of
# which stays in a layer:
#   secret extra_ca_certs  PEM certificates to trust besides the usual ones (a proxy that intercepts HTTPS)
#   secret pip_conf        a pip configuration file (index-url, extra-index-url, ...)
#   /wheels (docker/wheels) wheels pip may take before any index (find-links), e.g. torch's CPU build
# The combined CA bundle is written to a temporary file and removed before this returns.
set -eu
bundle=""
if [ -s /run/secrets/extra_ca_certs ]; then
  bundle=$(mktemp)
  for base in /etc/ssl/certs/ca-certificates.crt; do
    if [ -s "$base" ]; then cat "$base" >> "$bundle"; fi
  done
  cat /run/secrets/extra_ca_certs >> "$bundle"
  export PIP_CERT="$bundle" SSL_CERT_FILE="$bundle" REQUESTS_CA_BUNDLE="$bundle"
fi
if [ -s /run/secrets/pip_conf ]; then
  export PIP_CONFIG_FILE=/run/secrets/pip_conf
fi
if ls /wheels/*.whl >/dev/null 2>&1; then
  export PIP_FIND_LINKS="${PIP_FIND_LINKS:+$PIP_FIND_LINKS }/wheels"
fi
status=0
"$@" || status=$?
if [ -n "$bundle" ]; then rm -f "$bundle"; fi
exit "$status"
