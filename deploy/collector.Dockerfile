# The bytecp collector image (`bytecp monitor serve`), built from the repository root:
#   docker build -f deploy/collector.Dockerfile -t bytecp-collector .
# torch comes from the CPU wheel index: the collector never touches a GPU.
FROM python:3.12-slim
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY bytecp bytecp
COPY adapters adapters
COPY storage storage
COPY monitoring monitoring
RUN pip install --no-cache-dir -c constraints.txt --index-url https://download.pytorch.org/whl/cpu torch \
 && pip install --no-cache-dir -c constraints.txt ".[monitoring]" \
 && useradd --system --uid 10001 bytecp
USER bytecp
EXPOSE 7470 9470
ENTRYPOINT ["bytecp", "monitor"]
CMD ["serve", "--grpc", "0.0.0.0:7470", "--metrics", "0.0.0.0:9470"]
