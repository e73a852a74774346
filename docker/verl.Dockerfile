# veRL trainer image (GPU): the plugsearch trainer code with veRL 0.9.1 and its rollout engine, vLLM 0.24.0.
# Used by the RayJob in k8s/overlays/train (Ray head and GPU workers) and for single-node runs:
#
#   docker build -f docker/verl.Dockerfile -t plugsearch/trainer-verl:0.1.0 .
#   docker run --gpus all -e TRAINER_RETRIEVER__URL=... plugsearch/trainer-verl:0.1.0 trainer.n_gpus_per_node=8
#
# The pins travel together: veRL 0.9.1's own `vllm` extra requires vllm==0.24.0, torch==2.11.0 and
# transformers==5.9.0 (its wheel's METADATA), and vllm 0.24.0 requires torch==2.11.0. The base is vLLM's
# own image of that release (CUDA, torch and vLLM built together); pip may add packages around them but
# never replace them (the constraints below), and the `verl` extra of pyproject.toml pins the rest.
# Pin by digest in production: --build-arg VLLM_IMAGE=vllm/vllm-openai:v0.24.0@sha256:...

ARG VLLM_IMAGE=vllm/vllm-openai:v0.24.0
FROM ${VLLM_IMAGE} AS trainer-verl
ARG VERL_VERSION=0.9.1
ARG VLLM_VERSION=0.24.0
ARG TORCH_VERSION=2.11.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    HF_HOME=/var/lib/plugsearch/hf VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 RAY_USAGE_STATS_ENABLED=0 \
    PLUGSEARCH_VERL_DIR=/opt/plugsearch/plugsearch/trainer/verl PLUGSEARCH_VERL_DATA=/var/lib/plugsearch/verl/data \
    CHECKPOINT_DIR=/var/lib/plugsearch/verl/checkpoints
WORKDIR /opt/plugsearch
COPY pyproject.toml README.md ./
COPY plugsearch ./plugsearch
# optional build-time inputs as in docker/Dockerfile: secrets extra_ca_certs (PEM) and pip_conf, docker/wheels/
COPY docker/pip-install.sh /usr/local/bin/pip-install
RUN --mount=type=secret,id=extra_ca_certs --mount=type=secret,id=pip_conf \
    --mount=type=bind,source=docker/wheels,target=/wheels \
    python3 -m pip list --format=freeze | grep -iE '^(torch|vllm)==' > /tmp/keep.txt \
 && grep -qE "^vllm==${VLLM_VERSION}$" /tmp/keep.txt \
 && grep -qE "^torch==${TORCH_VERSION}([+].*)?$" /tmp/keep.txt \
 && pip-install python3 -m pip install -c /tmp/keep.txt ".[verl]" \
 && python3 -c "import verl, vllm, torch; assert verl.__version__ == '${VERL_VERSION}', verl.__version__" \
 && rm /tmp/keep.txt
RUN groupadd --system --gid 10001 app \
 && useradd --system --uid 10001 --gid app --home-dir /home/app --create-home --shell /bin/bash app \
 && mkdir -p /var/lib/plugsearch/hf /var/lib/plugsearch/verl \
 && chown -R app:app /var/lib/plugsearch
USER 10001:10001
ENTRYPOINT ["python3", "-m", "verl.trainer.main_ppo", "--config-path=/opt/plugsearch/plugsearch/trainer/verl", "--config-name=s3_grpo"]
