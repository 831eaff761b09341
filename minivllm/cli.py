"""`minivllm` command line: serve, generate, info, bench. It sits above service/ and bench/ and
wires them together; neither imports it."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys

from engine import EngineConfig

logger = logging.getLogger("minivllm")


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"MINIVLLM_{name.upper()}", default)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field; MINIVLLM_<FIELD> env vars set the defaults."""
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        default = _env(f.name)
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        if "bool" in kind:
            parser.add_argument(flag, type=lambda v: v.lower() in ("1", "true", "yes", "on"), default=default,
                                metavar="BOOL")
        elif "int" in kind:
            parser.add_argument(flag, type=int, default=default)
        elif "float" in kind:
            parser.add_argument(flag, type=float, default=default)
        else:
            parser.add_argument(flag, default=default)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    # argparse applies each flag's type to string defaults too, so env values arrive typed.
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    return EngineConfig(**{name: value for name, value in values.items() if value is not None})


async def _serve(args: argparse.Namespace) -> int:
    # The engine thread re-takes the GIL after every torch op; with the default 5 ms switch
    # interval a busy asyncio thread (streaming hundreds of messages/s) can hold it that long.
    sys.setswitchinterval(float(os.environ.get("MINIVLLM_SWITCH_INTERVAL", "0.0005")))
    from engine import model_display_name
    from service.observability import Observability
    from service.security import load_tokens
    from service.server import InferenceServer, ServerConfig

    config = ServerConfig(host=args.host, port=args.port, drain_grace_s=args.drain_grace,
                          max_message_bytes=args.max_message_bytes, max_concurrent_rpcs=args.max_concurrent_rpcs,
                          tls_cert_file=args.tls_cert, tls_key_file=args.tls_key, tls_client_ca_file=args.tls_client_ca,
                          auth_tokens=load_tokens(args.auth_token_file), engine=engine_config_from_args(args))
    obs = Observability.from_env(model_name=model_display_name(config.engine.model),
                                 metrics_port=args.metrics_port, metrics_host=args.metrics_host)
    server = InferenceServer(config, stats_listeners=[obs.on_step], observer=obs.request_observer,
                             interceptors=obs.interceptors())
    server.install_signal_handlers()
    await server.start()
    await server.wait_stopped()
    obs.shutdown()
    return server.exit_code


def _generate(args: argparse.Namespace) -> int:
    import grpc


    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    with _client(args, timeout=args.timeout) as client:
        try:
            for chunk in client.generate(prompt, max_tokens=args.max_tokens, temperature=args.temperature):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.finish_reason:
                    sys.stdout.write("\n")
                    logger.info("finish_reason=%s prompt_tokens=%d completion_tokens=%d", chunk.finish_reason,
                                chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
        except grpc.RpcError as err:
            logger.error("%s: %s", err.code().name, err.details())
            return 1
    return 0


def _client(args: argparse.Namespace, timeout: float | None = None) -> object:
    from service.client import InferenceClient

    return InferenceClient(args.target, timeout=timeout, tls_ca_file=args.tls_ca, tls_cert_file=args.tls_cert,
                           tls_key_file=args.tls_key, token=args.token)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="minivllm", description="A small, real LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the gRPC server")
    serve.add_argument("--host", default=_env("host", "0.0.0.0"))
    serve.add_argument("--port", type=int, default=int(_env("port", "50051")))
    serve.add_argument("--metrics-host", default=_env("metrics_host", "0.0.0.0"))
    serve.add_argument("--metrics-port", type=int, default=int(_env("metrics_port", "9400")),
                       help="Prometheus /metrics port (0: off)")
    serve.add_argument("--drain-grace", type=float, default=float(_env("drain_grace", "30")),
                       help="seconds running streams get to finish on SIGTERM")
    serve.add_argument("--max-message-bytes", type=int, default=int(_env("max_message_bytes", str(4 * 2**20))),
                       help="largest request message accepted")
    serve.add_argument("--max-concurrent-rpcs", type=int, default=int(_env("max_concurrent_rpcs", "1024")),
                       help="calls in flight at once; more are refused with RESOURCE_EXHAUSTED")
    serve.add_argument("--tls-cert", default=_env("tls_cert"), help="server certificate (PEM): serve TLS only")
    serve.add_argument("--tls-key", default=_env("tls_key"), help="server private key (PEM)")
    serve.add_argument("--tls-client-ca", default=_env("tls_client_ca"),
                       help="CA (PEM) whose client certificates are required (mutual TLS)")
    serve.add_argument("--auth-token-file", default=_env("auth_token_file"),
                       help="bearer tokens, one per line (also MINIVLLM_AUTH_TOKENS=a,b); health stays open")
    add_engine_args(serve)

    gen = sub.add_parser("generate", help="stream one completion to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--target", default=_env("target", "localhost:50051"))
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--timeout", type=float, default=None)

    info = sub.add_parser("info", help="print the served model's info")
    info.add_argument("--target", default=_env("target", "localhost:50051"))
    for client_parser in (gen, info):
        client_parser.add_argument("--tls-ca", default=_env("tls_ca"), help="CA (PEM) of the server: use TLS")
        client_parser.add_argument("--tls-cert", default=_env("client_tls_cert"), help="client certificate (mTLS)")
        client_parser.add_argument("--tls-key", default=_env("client_tls_key"), help="client key (mTLS)")
        client_parser.add_argument("--token", default=_env("token"), help="bearer token (or MINIVLLM_TOKEN)")

    sub.add_parser("bench", help="serving benchmark; `minivllm bench --help` for its options")

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":  # the benchmark owns its whole command line
        from bench.serving import main as bench_main

        bench_main(argv[1:])
        return
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("MINIVLLM_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        sys.exit(asyncio.run(_serve(args)))
    elif args.command == "generate":
        sys.exit(_generate(args))
    elif args.command == "info":

        with _client(args) as client:
            sys.stdout.write(str(client.model_info()))


if __name__ == "__main__":
    main()
