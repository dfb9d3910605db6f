"""The `kvd` command: serve, gateway, generate, chat, stats, top, tokenize. Only `serve` imports torch."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import kvd
from kvd.engine import engine_args
from kvd.engine.engine_args import EngineArgs, EngineArgsError
from kvd.gateway.server import DEFAULT_HTTP
from kvd.server.config import ServerConfig
from kvd.server.config_file import ConfigFileError, apply_config_file
from kvd_client import Client, KvdError
from kvd_client.client import DEFAULT_TIMEOUT_S
from kvd_client.endpoint import resolve_endpoint

CHAT_HELP = "/reset clears the history, /help shows this, /exit (or Ctrl-D) quits"


def parse_size(text: str) -> int:
    """Bytes from "1073741824", "512M", "2G", "1.5GiB" (binary units), as an argparse type."""
    try:
        return engine_args.parse_size(text)
    except EngineArgsError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None) is not None:
        try:
            apply_config_file(_subcommand(parser, "serve"), args.config)
        except ConfigFileError as e:
            print(f"kvd serve: {e}", file=sys.stderr)
            return 2
        args = parser.parse_args(argv)  # again: the file's settings are now defaults the flags override
    try:
        return args.run(args)
    except KvdError as e:
        print(f"kvd {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Streams were closed (and aborted in the daemon) on the way out.
        print(file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvd", description="A local LLM inference daemon and its client.")
    parser.add_argument("--version", action="version", version=f"kvd {kvd.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _serve_parser(commands.add_parser("serve", help="run the daemon (loads the model)"))
    _gateway_parser(
        commands.add_parser("gateway", help="an OpenAI-compatible HTTP server in front of a daemon")
    )

    generate = commands.add_parser("generate", help="complete a prompt, streaming to stdout")
    generate.add_argument("prompt", help="the prompt; - reads it from standard input")
    _sampling_flags(generate, max_tokens_default="the daemon's, 16")
    _client_flags(generate, _generate)

    chat = commands.add_parser("chat", help="an interactive chat with history (/reset, /help, /exit)")
    chat.add_argument("--system", help="a system message that starts the conversation")
    _sampling_flags(chat, max_tokens_default="until the reply ends or the context is full")
    _client_flags(chat, _chat)

    stats = commands.add_parser("stats", help="KV usage, prefix hit rate, requests, tokens/s")
    stats.add_argument("--json", action="store_true", help="print the raw stats map as JSON")
    _client_flags(stats, _stats)

    top = commands.add_parser("top", help="a live view of the daemon's load and its clients")
    top.add_argument("--once", action="store_true", help="print one screen and exit")
    top.add_argument("--interval", type=float, default=1.0, help="seconds between redraws (%(default)s)")
    _client_flags(top, _top)

    tokenize = commands.add_parser("tokenize", help="print the token ids of a text")
    tokenize.add_argument("text")
    _client_flags(tokenize, _tokenize)
    return parser


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[name]


def _serve_parser(p: argparse.ArgumentParser) -> None:
    # Defaults come from the settings classes themselves, so the flags cannot drift from them.
    e, c = EngineArgs, ServerConfig
    p.add_argument(
        "--config",
        type=Path,
        help="a TOML file of these settings, named without dashes (systemd/kvd.toml.example); flags win",
    )
    model = p.add_argument_group("model and engine")
    model.add_argument(
        "--model", help="folder, .gguf file or Hugging Face id (default: bundled SmolLM2-135M)"
    )
    model.add_argument("--dtype", default=e.dtype, help="auto, float32, bfloat16 or float16 (%(default)s)")
    model.add_argument("--device", default=e.device, help="cpu or cuda[:N] (%(default)s)")
    model.add_argument(
        "--quantization",
        default=e.quantization,
        choices=["auto", "none", "int8", "int4"],
        help="CPU: keep decoder weights quantized; auto = what a GGUF file holds, none = dequantize (%(default)s)",
    )
    model.add_argument(
        "--kv-cache-memory",
        type=parse_size,
        help=f"KV pool size, e.g. 512M or 2G (default: {e.kv_cache_memory_fraction:.0%}% of free)",
    )
    model.add_argument(
        "--max-num-seqs", type=int, default=e.max_num_seqs, help="sequences per batch (%(default)s)"
    )
    model.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=e.max_num_batched_tokens,
        help="tokens per step (%(default)s)",
    )
    model.add_argument("--max-model-len", type=int, help="context length cap (default: the model's)")
    model.add_argument(
        "--block-size",
        type=positive_int,
        default=e.block_size,
        help="tokens per KV block (default: the attention backend's; 16, or 256 for flash-attn)",
    )
    model.add_argument("--no-prefix-caching", action="store_true", help="do not reuse cached prompt prefixes")
    model.add_argument(
        "--num-threads",
        "--threads",
        type=positive_int,
        help="CPU threads for torch, num_threads in the Python API (default: all cores)",
    )
    model.add_argument(
        "--attention-backend",
        default=e.attention_backend,
        choices=["auto", "torch", "native", "triton", "flash-attn"],
        help="auto: flash-attn, else triton on CUDA; native (kvd's kernels), else torch on CPU (%(default)s)",
    )
    model.add_argument(
        "--enforce-eager", action="store_true", help="CUDA: no CUDA graphs and no torch.compile"
    )
    model.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=e.gpu_memory_utilization,
        help="CUDA: the share of the device's memory this process may use, KV pool included (%(default)s)",
    )

    server = p.add_argument_group("daemon")
    server.add_argument(
        "--listen", help="ipc://PATH or tcp://127.0.0.1:PORT (default: $KVD_ENDPOINT or per-user)"
    )
    server.add_argument(
        "--events", help="publish queued/scheduled/preempted/finished events on this endpoint (default: off)"
    )
    server.add_argument("--socket-group", help="make the ipc socket 0660 with this group (default: 0600)")
    server.add_argument(
        "--allow-remote", action="store_true", help="permit a non-loopback tcp or --http address"
    )
    server.add_argument(
        "--http",
        metavar="HOST:PORT",
        help=f"also run the OpenAI-compatible HTTP gateway (kvd gateway) there, e.g. {DEFAULT_HTTP} (default: off)",
    )
    server.add_argument(
        "--shared-prefix-cache",
        action="store_true",
        help="let different users share cached prompt prefixes (trusted single-tenant hosts only)",
    )
    server.add_argument(
        "--drain-timeout",
        type=float,
        default=c.drain_timeout,
        help="seconds to finish on SIGTERM (%(default)s)",
    )
    server.add_argument(
        "--client-timeout",
        type=float,
        default=c.client_timeout,
        help="seconds a client may leave replies unread (%(default)s)",
    )
    server.add_argument(
        "--max-message-bytes",
        type=parse_size,
        default=c.max_message_bytes,
        help="request size limit (%(default)s)",
    )
    server.add_argument(
        "--max-prompt-tokens", type=int, help="prompt length limit (default: max_model_len - 1)"
    )
    server.add_argument(
        "--max-queued-per-client",
        type=int,
        default=c.max_queued_per_client,
        help="requests in flight per client (%(default)s)",
    )
    server.add_argument(
        "--max-queued", type=int, default=c.max_queued, help="requests in flight in total (%(default)s)"
    )
    server.add_argument(
        "--max-running-per-client",
        type=int,
        help="requests per client in the engine at once; the rest wait their turn (default: no cap)",
    )
    server.add_argument(
        "--max-blocks-per-client",
        type=int,
        help="KV blocks one client's requests may hold; more of them wait (default: no cap)",
    )
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(run=_serve)


def _gateway_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--http", default=DEFAULT_HTTP, metavar="HOST:PORT", help="where to serve HTTP (%(default)s)"
    )
    p.add_argument(
        "--allow-remote", action="store_true", help="permit a non-loopback address (no authentication!)"
    )
    p.add_argument("--served-model-name", help="the model id clients use (default: the daemon's model name)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    _client_flags(p, _gateway)


def _sampling_flags(p: argparse.ArgumentParser, max_tokens_default: str) -> None:
    p.add_argument(
        "--max-tokens", type=positive_int, help=f"tokens to generate at most (default: {max_tokens_default})"
    )
    p.add_argument("--temperature", type=float, help="0 = greedy (default: the daemon's, 1.0)")
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--min-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")


def _client_flags(p: argparse.ArgumentParser, run: object) -> None:
    p.add_argument("--endpoint", help="the daemon's endpoint (default: $KVD_ENDPOINT or per-user)")
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds to wait on a silent daemon (%(default)s)",
    )
    p.set_defaults(run=run)


def _serve(args: argparse.Namespace) -> int:
    # Imported here: every other command runs without torch.
    from kvd.gateway.server import GatewayConfigError
    from kvd.server.listener import ListenError
    from kvd.server.serve import serve

    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        engine_args = EngineArgs(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            quantization=args.quantization,
            block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            enable_prefix_caching=not args.no_prefix_caching,
            num_threads=args.num_threads,
            attention_backend=args.attention_backend,
            enforce_eager=args.enforce_eager,
            gpu_memory_utilization=args.gpu_memory_utilization,
        )
        config = ServerConfig(
            listen=args.listen,
            socket_group=args.socket_group,
            events=args.events,
            allow_remote=args.allow_remote,
            http=args.http,
            shared_prefix_cache=args.shared_prefix_cache,
            drain_timeout=args.drain_timeout,
            client_timeout=args.client_timeout,
            max_message_bytes=args.max_message_bytes,
            max_prompt_tokens=args.max_prompt_tokens,
            max_queued_per_client=args.max_queued_per_client,
            max_queued=args.max_queued,
            max_running_per_client=args.max_running_per_client,
            max_blocks_per_client=args.max_blocks_per_client,
        )
        serve(engine_args, config)
    except (ListenError, ValueError, FileNotFoundError, GatewayConfigError) as e:
        # Configuration and input mistakes: one clear line, no traceback.
        print(f"kvd serve: {e}", file=sys.stderr)
        return 2
    return 0


def _gateway(args: argparse.Namespace) -> int:
    from kvd.gateway.server import GatewayConfig, GatewayConfigError, parse_http_address, run_gateway

    try:
        host, port = parse_http_address(args.http, args.allow_remote)
        endpoint = resolve_endpoint(args.endpoint).url
    except (GatewayConfigError, KvdError) as e:
        print(f"kvd gateway: {e}", file=sys.stderr)
        return 2
    run_gateway(
        GatewayConfig(
            host, port, endpoint, args.allow_remote, args.served_model_name, args.timeout, args.log_level
        )
    )
    return 0


def _connect(args: argparse.Namespace) -> Client:
    """A Client for --endpoint; a daemon that is not there is reported at once, naming the flag."""
    endpoint = resolve_endpoint(args.endpoint)
    endpoint.check_listening("--endpoint")
    return Client(endpoint.url, timeout=args.timeout)


def _sampling(args: argparse.Namespace) -> dict:
    names = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop")
    return {n: getattr(args, n) for n in names} | {"ignore_eos": args.ignore_eos or None}


def _generate(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    with _connect(args) as client, client.stream(prompt, **_sampling(args)) as s:
        for chunk in s:
            print(chunk.text, end="", flush=True)
    print()
    if chunk.finish_reason == "abort":
        print("kvd generate: cut short: the daemon stopped before the generation finished", file=sys.stderr)
        return 1
    return 0


def _chat(args: argparse.Namespace) -> int:
    history = [{"role": "system", "content": args.system}] if args.system else []
    print(f"kvd chat: {CHAT_HELP}", file=sys.stderr)
    with _connect(args) as client:
        if args.max_tokens is None:
            # A chat reply ends when the model ends it; the daemon stops it when the context is full.
            args.max_tokens = client.info()["max_model_len"]
        while True:
            try:
                line = input("> ")
            except (EOFError, KeyboardInterrupt):
                print()
                return 0
            command = line.strip()
            if command == "/exit":
                return 0
            if command == "/reset":
                del history[1 if args.system else 0 :]
                print("(history cleared)", file=sys.stderr)
                continue
            if command.startswith("/"):
                known = command == "/help"
                print(CHAT_HELP if known else f"unknown command {command}; {CHAT_HELP}", file=sys.stderr)
                continue
            if not command:
                continue
            history.append({"role": "user", "content": line})
            reply = _stream_reply(client, history, args)
            history.append({"role": "assistant", "content": reply})


def _stream_reply(client: Client, history: list[dict[str, str]], args: argparse.Namespace) -> str:
    """Print the assistant's reply as it streams; Ctrl-C stops it (and aborts it in the daemon)."""
    parts = []
    with client.stream_chat(history, **_sampling(args)) as stream:
        try:
            for chunk in stream:
                parts.append(chunk.text)
                print(chunk.text, end="", flush=True)
                if chunk.finish_reason == "abort":
                    print(" [cut short: the daemon stopped]", end="")
        except KeyboardInterrupt:
            print(" [stopped]", end="")
    print()
    return "".join(parts)


def _stats(args: argparse.Namespace) -> int:
    with _connect(args) as client:
        stats = client.stats()
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
        return 0
    kv, prefix, daemon = stats["kv_cache"], stats["prefix_cache"], stats["daemon"]
    total = kv["total_blocks"]
    print(f"KV cache      {kv['used_blocks']}/{total} blocks used ({100 * kv['used_blocks'] / total:.1f} %)")
    print(f"prefix cache  {100 * prefix['hit_rate']:.1f} % hit rate ({prefix['hit_tokens']} tokens reused)")
    print(f"requests      {stats['num_running']} running, {stats['num_waiting']} waiting")
    print(f"throughput    {stats['generation_tokens_per_s_1m']:.1f} tokens/s (last minute)")
    print(f"clients       {daemon['num_clients']} active; {daemon['requests_total']} requests since start")
    return 0


def _top(args: argparse.Namespace) -> int:
    from kvd.top import run

    with _connect(args) as client:
        run(client, args.interval, args.once)
    return 0


def _tokenize(args: argparse.Namespace) -> int:
    with _connect(args) as client:
        token_ids = client.tokenize(args.text)
    print(" ".join(map(str, token_ids)))
    print(f"{len(token_ids)} tokens", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
