"""The `minivllm` command line: the layer above the engine, the service and the benchmarks."""
