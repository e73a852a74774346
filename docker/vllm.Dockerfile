# GPU LLM server: vLLM's OpenAI-compatible server (the same API the services call on llama.cpp).
# Used for the searcher policy and for the generator/judge model (docker-compose profile `gpu`,
# k8s overlay `gpu`). The upstream image already is the runtime; this adds a non-root user, a
# writable model cache and a healthcheck.
#
#   docker build -f docker/vllm.Dockerfile -t plugsearch/vllm:0.1.0 .
#   docker run --gpus all -p 8000:8000 plugsearch/vllm:0.1.0 --model Qwen/Qwen2.5-7B-Instruct --port 8000

ARG VLLM_IMAGE=vllm/vllm-openai:v0.11.0
FROM ${VLLM_IMAGE}
ENV HF_HOME=/var/lib/plugsearch/hf \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1
RUN groupadd --system --gid 10001 app \
 && useradd --system --uid 10001 --gid app --home-dir /home/app --create-home --shell /usr/sbin/nologin app \
 && mkdir -p /var/lib/plugsearch/hf \
 && chown -R app:app /var/lib/plugsearch
COPY docker/healthcheck.py /usr/local/bin/plugsearch-healthcheck
USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=4s --start-period=900s --retries=3 \
  CMD ["python3", "/usr/local/bin/plugsearch-healthcheck", "/health", "8000"]
ENTRYPOINT ["python3", "-m", "vllm.entrypoints.openai.api_server", "--host", "0.0.0.0"]
CMD ["--port", "8000"]
