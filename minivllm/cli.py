"""`minivllm` command line: serve, generate, info, bench. It sits above service/ and bench/ and
wires them together; neither imports it.

The client commands (generate, info) import neither torch nor transformers: only `serve`
loads the engine, so a thin client starts in a fraction of a second.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import sys
from importlib import metadata
from typing import Any

logger = logging.getLogger("minivllm")

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"MINIVLLM_{name.upper()}", default)


def _env_bool(name: str, default: bool) -> bool:
    value = _env(name)
    if value is None:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise SystemExit(f"minivllm: error: MINIVLLM_{name.upper()}={value!r} is not a boolean (true/false)")


def _version() -> str:
    try:
        return metadata.version("minivllm")
    except metadata.PackageNotFoundError:
        return "unknown"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, with the field's own help text; MINIVLLM_<FIELD> env
    vars set the defaults. Booleans are --flag / --no-flag."""
    from engine import EngineConfig

    group = parser.add_argument_group("engine", "also settable as MINIVLLM_<FLAG> environment variables")
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        help_text = f"{f.metadata.get('help', '')} (default: {default}; env MINIVLLM_{f.name.upper()})"
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        if "bool" in kind:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=_env_bool(f.name, default),
                               help=help_text)
            continue
        convert = int if "int" in kind else float if "float" in kind else str
        # argparse applies `type` to string defaults too, so env values arrive typed (and checked).
        group.add_argument(flag, type=convert, default=_env(f.name), help=help_text,
                           metavar=f.name.upper() if convert is str else convert.__name__.upper())


def engine_config_from_args(args: argparse.Namespace) -> Any:
    from engine import EngineConfig

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    return EngineConfig(**{name: value for name, value in values.items() if value is not None})


def _add_serve_args(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--host", default=_env("host", "0.0.0.0"), help="gRPC listen address (env MINIVLLM_HOST)")
    serve.add_argument("--port", type=int, default=int(_env("port", "50051")),
                       help="gRPC port; 0 picks a free one (env MINIVLLM_PORT)")
    serve.add_argument("--http-host", default=_env("http_host", None),
                       help="OpenAI-compatible HTTP listen address; default: --host (env MINIVLLM_HTTP_HOST)")
    serve.add_argument("--http-port", type=int, default=int(_env("http_port", "8000")),
                       help="OpenAI-compatible HTTP port (/v1/completions, /v1/chat/completions, /v1/models, "
                            "/health); 0: off (default 8000; env MINIVLLM_HTTP_PORT)")
    serve.add_argument("--served-model-name", default=_env("served_model_name"),
                       help="model name clients send and see (OpenAI `model`, metrics label); default: the "
                            "model's own name (env MINIVLLM_SERVED_MODEL_NAME)")
    serve.add_argument("--tool-call-parser", default=_env("tool_call_parser", "auto"),
                       help="tool-call format: auto (from the chat template; harmony for gpt-oss), hermes, "
                            "llama3_json, mistral or harmony (env MINIVLLM_TOOL_CALL_PARSER)")
    serve.add_argument("--reasoning-parser", default=_env("reasoning_parser", "auto"),
                       help="move <think> blocks into reasoning_content: auto (default: from the chat template: "
                            "qwen3 for a template that writes <think> blocks, deepseek_r1 for one whose prompt "
                            "opens one; harmony for gpt-oss), deepseek_r1, qwen3, harmony (gpt-oss's analysis channel), or none "
                            "(env MINIVLLM_REASONING_PARSER)")
    serve.add_argument("--max-stored-responses", type=int, default=int(_env("max_stored_responses", "1024")),
                       help="/v1/responses kept for previous_response_id, oldest dropped first "
                            "(env MINIVLLM_MAX_STORED_RESPONSES)")
    serve.add_argument("--metrics-host", default=_env("metrics_host", "0.0.0.0"),
                       help="Prometheus /metrics listen address (env MINIVLLM_METRICS_HOST)")
    serve.add_argument("--metrics-port", type=int, default=int(_env("metrics_port", "9400")),
                       help="Prometheus /metrics port; 0: off (env MINIVLLM_METRICS_PORT)")
    serve.add_argument("--drain-grace", type=float, default=float(_env("drain_grace", "30")),
                       help="seconds running streams get to finish on SIGTERM (env MINIVLLM_DRAIN_GRACE)")
    serve.add_argument("--max-message-bytes", type=int, default=int(_env("max_message_bytes", str(4 * 2**20))),
                       help="largest request message or HTTP body accepted (env MINIVLLM_MAX_MESSAGE_BYTES)")
    serve.add_argument("--max-concurrent-rpcs", type=int, default=int(_env("max_concurrent_rpcs", "1024")),
                       help="gRPC calls in flight at once; more are refused with RESOURCE_EXHAUSTED "
                            "(env MINIVLLM_MAX_CONCURRENT_RPCS)")
    serve.add_argument("--tls-cert", default=_env("tls_cert"),
                       help="server certificate (PEM): serve gRPC over TLS only (env MINIVLLM_TLS_CERT)")
    serve.add_argument("--tls-key", default=_env("tls_key"), help="server private key (PEM) (env MINIVLLM_TLS_KEY)")
    serve.add_argument("--tls-client-ca", default=_env("tls_client_ca"),
                       help="CA (PEM) whose client certificates are required: mutual TLS (env MINIVLLM_TLS_CLIENT_CA)")
    serve.add_argument("--auth-token-file", default=_env("auth_token_file"),
                       help="bearer tokens, one per line (also MINIVLLM_AUTH_TOKENS=a,b); required on gRPC and "
                            "HTTP calls, health stays open (env MINIVLLM_AUTH_TOKEN_FILE)")
    serve.add_argument("--grpc-services", default=_env("grpc_services", "minivllm,vllm"),
                       help="gRPC services on --port, comma-separated: minivllm (minivllm.v1.Inference) and/or vllm "
                            "(vLLM's engine contract vllm.grpc.engine.VllmEngine, for gateways such as SMG) "
                            "(default: both; env MINIVLLM_GRPC_SERVICES)")
    add_engine_args(serve)


def _add_client_args(parser: argparse.ArgumentParser, timeout: float) -> None:
    parser.add_argument("--target", default=_env("target", "localhost:50051"),
                        help="server host:port; several as ip:port,ip:port or dns:///name:port, balanced "
                             "round-robin (env MINIVLLM_TARGET)")
    parser.add_argument("--timeout", type=float, default=timeout, help=f"seconds before giving up (default {timeout})")
    parser.add_argument("--tls-ca", default=_env("tls_ca"), help="CA (PEM) of the server: use TLS (env MINIVLLM_TLS_CA)")
    parser.add_argument("--tls-cert", default=_env("client_tls_cert"),
                        help="client certificate for mutual TLS (env MINIVLLM_CLIENT_TLS_CERT)")
    parser.add_argument("--tls-key", default=_env("client_tls_key"),
                        help="client key for mutual TLS (env MINIVLLM_CLIENT_TLS_KEY)")
    parser.add_argument("--token", default=_env("token"), help="bearer token (env MINIVLLM_TOKEN)")


def build_parser(with_serve_args: bool = True) -> argparse.ArgumentParser:
    """with_serve_args=False skips the engine flags, which need the engine package (torch)."""
    parser = argparse.ArgumentParser(prog="minivllm", description="A small, real LLM serving engine")
    parser.add_argument("--version", action="version", version=f"minivllm {_version()}")
    parser.add_argument("--log-level", default=_env("log_level", "INFO").upper(),
                        choices=("DEBUG", "INFO", "WARNING", "ERROR"), type=str.upper,
                        help="log level (env MINIVLLM_LOG_LEVEL)")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the gRPC (and OpenAI-compatible HTTP) server",
                           description="Serve a model over gRPC and OpenAI-compatible HTTP.")
    if with_serve_args:
        _add_serve_args(serve)

    gen = sub.add_parser("generate", help="stream one completion to the terminal",
                         description="Stream one completion. The prompt comes from the argument, or from "
                                     "standard input when it is '-' or absent.")
    gen.add_argument("prompt", nargs="?", default="-", help="prompt text; '-' or absent: read standard input")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user chat message (chat template)")
    gen.add_argument("--system", default=None, help="system message (implies --chat)")
    gen.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    gen.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default 1.0: off)")
    gen.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    _add_client_args(gen, timeout=600.0)

    info = sub.add_parser("info", help="print the served model's info")
    info.add_argument("--json", action="store_true", help="print JSON")
    _add_client_args(info, timeout=10.0)

    sub.add_parser("bench", help="serving benchmark; `minivllm bench --help` for its options", add_help=False)
    return parser


async def _serve(args: argparse.Namespace) -> int:
    # The engine thread re-takes the GIL after every torch op; with the default 5 ms switch
    # interval a busy asyncio thread (streaming hundreds of messages/s) can hold it that long.
    sys.setswitchinterval(float(os.environ.get("MINIVLLM_SWITCH_INTERVAL", "0.0005")))
    from engine import model_display_name
    from service.grpc.security import load_tokens
    from service.observability.wiring import Observability
    from service.server import InferenceServer, ServerConfig

    engine_config = engine_config_from_args(args)
    model_name = args.served_model_name or model_display_name(engine_config.model)
    config = ServerConfig(host=args.host, port=args.port, drain_grace_s=args.drain_grace,
                          max_message_bytes=args.max_message_bytes, max_concurrent_rpcs=args.max_concurrent_rpcs,
                          tls_cert_file=args.tls_cert, tls_key_file=args.tls_key, tls_client_ca_file=args.tls_client_ca,
                          auth_tokens=load_tokens(args.auth_token_file), engine=engine_config,
                          http_host=args.http_host or args.host, http_port=args.http_port or None,
                          served_model_name=model_name, tool_call_parser=args.tool_call_parser,
                          reasoning_parser=args.reasoning_parser or None,
                          max_stored_responses=args.max_stored_responses,
                          grpc_services=tuple(s.strip() for s in args.grpc_services.split(",") if s.strip()))
    obs = Observability.from_env(model_name=model_name, metrics_port=args.metrics_port, metrics_host=args.metrics_host)
    server = InferenceServer(config, stats_listeners=[obs.on_step], observer=obs.request_observer,
                             interceptors=obs.interceptors(), on_http_call=obs.metrics.on_api_call)
    server.install_signal_handlers()
    await server.start()
    await server.wait_stopped()
    obs.shutdown()
    return server.exit_code


def _client(args: argparse.Namespace) -> Any:
    from service.grpc.minivllm_client import InferenceClient

    return InferenceClient(args.target, timeout=args.timeout, tls_ca_file=args.tls_ca, tls_cert_file=args.tls_cert,
                           tls_key_file=args.tls_key, token=args.token)


def _rpc_error_line(err: Any, target: str) -> str:
    import grpc

    code, details = err.code(), err.details() or ""
    if code is grpc.StatusCode.UNAVAILABLE and "loading" in details:
        return f"server at {target}: {details}; try again shortly"  # details name the start-up phase
    if code is grpc.StatusCode.UNAVAILABLE:
        return f"cannot reach a serving minivllm at {target} ({details.splitlines()[0] if details else code.name})"
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"no answer from {target} within the timeout"
    return f"{code.name}: {details}"


def _generate(args: argparse.Namespace) -> int:
    import grpc

    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not text.strip():
        logger.error("prompt: empty (give it as an argument or on standard input)")
        return 2
    if args.chat or args.system is not None:
        prompt: Any = ([{"role": "system", "content": args.system}] if args.system is not None else []) + \
            [{"role": "user", "content": text}]
    else:
        prompt = text
    sampling: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    for name in ("top_p", "seed"):
        if getattr(args, name) is not None:
            sampling[name] = getattr(args, name)
    if args.stop:
        sampling["stop"] = args.stop
    with _client(args) as client:
        try:
            for chunk in client.generate(prompt, **sampling):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.finish_reason:
                    logger.info("finish_reason=%s prompt_tokens=%d completion_tokens=%d", chunk.finish_reason,
                                chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
        except grpc.RpcError as err:
            sys.stdout.write("\n")
            sys.stdout.flush()
            logger.error("%s", _rpc_error_line(err, args.target))
            return 1
    sys.stdout.write("\n")  # a terminal prompt must not follow the text on its last line
    return 0


def _info(args: argparse.Namespace) -> int:
    import grpc
    from google.protobuf import json_format

    with _client(args) as client:
        try:
            info = client.model_info()
        except grpc.RpcError as err:
            logger.error("%s", _rpc_error_line(err, args.target))
            return 1
    values = json_format.MessageToDict(info, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    if args.json:
        sys.stdout.write(json.dumps(values, indent=2) + "\n")
    else:
        sys.stdout.write("".join(f"{key}: {value}\n" for key, value in values.items()))
    return 0


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "gateway-policies"]:  # replicas behind SMG, one routing policy after another
        from bench.gateway_policies import main as policies_main

        policies_main(argv[2:])
        return
    if argv and argv[0] == "bench":  # the benchmark owns its whole command line
        from bench.serving import main as bench_main

        bench_main(argv[1:])
        return
    command = next((arg for arg in argv if arg in ("serve", "generate", "info")), None)
    args = build_parser(with_serve_args=command == "serve").parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        try:
            sys.exit(asyncio.run(_serve(args)))
        except ValueError as exc:  # a bad setting: one line, not a traceback
            logger.error("%s", exc)
            sys.exit(2)
    if args.command != "serve":  # client commands log bare messages: they talk to a person
        for handler in logging.getLogger().handlers:
            handler.setFormatter(logging.Formatter("minivllm: %(message)s"))
    if args.command == "generate":
        sys.exit(_generate(args))
    if args.command == "info":
        sys.exit(_info(args))


if __name__ == "__main__":
    main()
