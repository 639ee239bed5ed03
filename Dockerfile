# servegate: the gateway (`servegate serve`) and the simulator (`servegate sim`) in one
# slim, non-root image.   docker build -t servegate:dev .
FROM python:3.12-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/servegate
COPY pyproject.toml README.md /src/
COPY src /src/src
RUN /opt/servegate/bin/pip install /src

FROM python:3.12-slim
RUN groupadd --system --gid 10001 servegate \
 && useradd --system --uid 10001 --gid servegate --no-create-home --home-dir /tmp \
      --shell /usr/sbin/nologin servegate
COPY --from=build /opt/servegate /opt/servegate
ENV PATH=/opt/servegate/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
USER 10001:10001
WORKDIR /tmp
EXPOSE 8080 8000
ENTRYPOINT ["servegate"]
CMD ["serve", "--config", "/etc/servegate/config.yaml"]
