"""The `kvd` command: serve, gateway, generate, chat, info, stats, top, tokenize. Only `serve` imports torch."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import kvd
from kvd.engine.engine_args import EngineArgs
from kvd.gateway.server import DEFAULT_HTTP
from kvd.gateway.settings import GatewaySettings
from kvd.server.config import ServerConfig
from kvd.server.config_file import ConfigFileError, apply_config_file
from kvd.settings import add_flags, from_flags, positive_float, positive_int
from kvd_client import Client, KvdError
from kvd_client.client import DEFAULT_TIMEOUT_S
from kvd_client.endpoint import resolve_endpoint

CHAT_HELP = "/reset clears the history, /help shows this, /exit (or Ctrl-D) quits"


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
    except BrokenPipeError:
        # The reader went away (`kvd top | head`): stop quietly, with nothing left to flush to the pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


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
    _structured_flags(generate)
    _client_flags(generate, _generate)

    chat = commands.add_parser("chat", help="an interactive chat with history (/reset, /help, /exit)")
    chat.add_argument("--system", help="a system message that starts the conversation")
    _sampling_flags(chat, max_tokens_default="until the reply ends or the context is full")
    _client_flags(chat, _chat)

    info = commands.add_parser("info", help="the model, dtype, device, CPU kernel paths and limits")
    info.add_argument("--json", action="store_true", help="print the raw info map as JSON")
    _client_flags(info, _info)

    stats = commands.add_parser("stats", help="KV usage, prefix hit rate, requests, tokens/s")
    stats.add_argument("--json", action="store_true", help="print the raw stats map as JSON")
    _client_flags(stats, _stats)

    top = commands.add_parser("top", help="a live view of the daemon's load and its clients")
    top.add_argument("--once", action="store_true", help="print one screen and exit")
    top.add_argument(
        "--interval", type=positive_float, default=1.0, help="seconds between redraws (%(default)s)"
    )
    _client_flags(top, _top)

    tokenize = commands.add_parser("tokenize", help="print the token ids of a text")
    tokenize.add_argument("text")
    _client_flags(tokenize, _tokenize)

    _client_flags(
        commands.add_parser("models", help="the daemon's models: loaded, pinned or not"), _models, model=False
    )
    load = commands.add_parser("load", help="load a model of the daemon now")
    load.add_argument("name")
    load.add_argument(
        "--keep-alive", help="then keep it loaded this long idle: seconds or 30s, 5m, 1h; -1 for good"
    )
    _client_flags(load, _load, model=False)
    unload = commands.add_parser(
        "unload", help="unload a model of the daemon (once nothing is in flight for it)"
    )
    unload.add_argument("name")
    _client_flags(unload, _unload, model=False)
    return parser


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[name]


def _serve_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        type=Path,
        help="a TOML file of these settings, named without dashes (systemd/kvd.toml.example); flags win",
    )
    # The settings classes make their flags (kvd.settings), so a new setting is added in one place.
    # --model may be given several times: the daemon serves each (kvd.server.model_specs).
    add_flags(p.add_argument_group("model and engine"), EngineArgs, repeated={"model"})
    daemon = p.add_argument_group("daemon")
    add_flags(daemon, ServerConfig)
    daemon.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_flags(p.add_argument_group("the HTTP gateway of --http (as kvd gateway's flags)"), GatewaySettings)
    p.set_defaults(run=_serve)


def _gateway_parser(p: argparse.ArgumentParser) -> None:
    # Each gateway setting is declared once, here, and carried by kvd.gateway.server.GatewayConfig.
    p.add_argument(
        "--http",
        metavar="HOST:PORT",
        help=f"where to serve HTTP (default: {DEFAULT_HTTP}, unless --uds is given alone)",
    )
    p.add_argument(
        "--allow-remote",
        action="store_true",
        help="permit a non-loopback --http address (give API keys: without them anyone who reaches it may use it)",
    )
    add_flags(p, GatewaySettings)  # `kvd serve --http` takes these too
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


def _structured_flags(p: argparse.ArgumentParser) -> None:
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--json-schema", metavar="FILE", type=Path, help="constrain the output to this JSON schema (a file)"
    )
    group.add_argument("--json", action="store_true", help="constrain the output to a JSON object")
    group.add_argument("--regex", help="constrain the output to match this regular expression")
    group.add_argument("--grammar", metavar="FILE", type=Path, help="constrain the output to a Lark grammar")


def _structured(args: argparse.Namespace) -> dict:
    """The structured-output field the flags ask for; the daemon validates the file's contents."""
    fields = {"json_object": args.json or None, "regex": args.regex}
    for name, path in (("json_schema", args.json_schema), ("grammar", args.grammar)):
        if path is not None:
            try:
                fields[name] = path.read_text()
            except OSError as e:
                raise KvdError(f"--{name.replace('_', '-')} {path}: {e.strerror}") from None
    return fields


def _client_flags(p: argparse.ArgumentParser, run: object, model: bool = True) -> None:
    p.add_argument("--endpoint", help="the daemon's endpoint (default: $KVD_ENDPOINT or per-user)")
    if model:
        p.add_argument(
            "--model", help="which of the daemon's models (`kvd models` lists them; default: its only one)"
        )
    p.add_argument(
        "--timeout",
        type=positive_float,
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
        models, args.model = args.model or [], None
        engine_args = from_flags(EngineArgs, args)
        config = from_flags(ServerConfig, args)
        tables = getattr(args, "model_tables", None)  # a config file's [[models]] settings
        serve(engine_args, config, from_flags(GatewaySettings, args), models, tables)
    except (ListenError, ValueError, FileNotFoundError, GatewayConfigError) as e:
        # Configuration and input mistakes: one clear line, no traceback.
        print(f"kvd serve: {e}", file=sys.stderr)
        return 2
    return 0


def _gateway(args: argparse.Namespace) -> int:
    from kvd.gateway.keys import ENV_KEY, load_api_keys
    from kvd.gateway.server import (
        GatewayConfig,
        GatewayConfigError,
        check_port_free,
        parse_http_address,
        run_gateway,
    )

    settings = from_flags(GatewaySettings, args)
    try:
        host, port = None, 0
        if args.http is not None or settings.uds is None:
            host, port = parse_http_address(args.http or DEFAULT_HTTP, args.allow_remote)
            check_port_free(host, port)  # a port in use is a configuration error (status 2), not a crash
        endpoint = resolve_endpoint(args.endpoint).url
        # Read once, at start; a key is never a flag's value (flags show in `ps`).
        keys = load_api_keys(settings.api_key_file, os.environ.get(ENV_KEY))
        config = GatewayConfig(
            host,
            port,
            endpoint,
            allow_remote=args.allow_remote,
            served_model_name=settings.served_model_name,
            timeout=args.timeout,
            log_level=args.log_level,
            uds=settings.uds,
            api_keys=keys,
            allowed_hosts=settings.allowed_host,
        )
        run_gateway(config)  # binding a listener may still fail
    except (GatewayConfigError, KvdError) as e:
        print(f"kvd gateway: {e}", file=sys.stderr)
        return 2
    return 0


def _connect(args: argparse.Namespace) -> Client:
    """A Client for --endpoint; a daemon that is not there is reported at once, naming the flag."""
    endpoint = resolve_endpoint(args.endpoint)
    endpoint.check_listening("--endpoint")
    return Client(endpoint.url, timeout=args.timeout)


def _sampling(args: argparse.Namespace) -> dict:
    names = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "model")
    return {n: getattr(args, n) for n in names} | {"ignore_eos": args.ignore_eos or None}


def _generate(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    fields = _sampling(args) | _structured(args)
    with _connect(args) as client, client.stream(prompt, **fields) as s:
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
            args.max_tokens = (
                client.load(args.model)["max_model_len"] if args.model else client.info()["max_model_len"]
            )
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


def _asked(args: argparse.Namespace, ask: Callable[[Client], dict]) -> dict | None:
    """The daemon's answer (its info or stats); with --json printed as it is, and None."""
    with _connect(args) as client:
        answer = ask(client)
    if args.json:
        print(json.dumps(answer, indent=2, sort_keys=True))
        return None
    return answer


def _info(args: argparse.Namespace) -> int:
    info = _asked(args, lambda client: client.info(args.model))
    if info is None:
        return 0
    if not info["loaded"]:
        print(f"model         {info['model']}: not loaded (it loads on its first request, or with kvd load)")
        return 0
    weights = (
        f"{info['quantization']} weights" if info["quantization"] not in (None, "none") else "float weights"
    )
    print(f"model         {info['model']} ({info['dtype']}, {weights}; kvd {info['kvd_version']})")
    print(
        f"device        {info['device']}, {info['threads']} threads; CPU kernels: {info['cpu_kernels'] or 'none'}"
    )
    print(
        f"KV pool       {info['num_blocks']} blocks x {info['block_size']} tokens ({info['kv_cache_dtype']}); "
        f"max_model_len {info['max_model_len']}; attention {info['attention_backend']}"
    )
    print(
        f"batching      up to {info['max_num_seqs']} sequences, {info['max_num_batched_tokens']} tokens a step"
    )
    print(weights_line(info))
    limits = info["limits"]
    print(
        f"limits        {limits['max_prompt_tokens']} prompt tokens, {limits['max_queued_per_client']} requests "
        f"per client, {limits['max_queued']} in all"
    )
    return 0


def weights_line(info: dict) -> str:
    """The weight bytes this process holds, and a GGUF file's tensors by type as the file stores them (most
    bytes first)."""
    line = f"weights       {info['weight_bytes'] / 2**20:.1f} MiB held"
    types = sorted((info.get("file_types") or {}).items(), key=lambda item: -item[1]["bytes"])
    if types:
        parts = [f"{name} {t['tensors']} tensors {t['bytes'] / 2**20:.1f} MiB" for name, t in types]
        line += "; in the file: " + ", ".join(parts)
    return line


def _stats(args: argparse.Namespace) -> int:
    stats = _asked(args, lambda client: client.stats(args.model))
    if stats is None:
        return 0
    if "kv_cache" not in stats:
        print(f"model         {stats['model']}: not loaded")
        return 0
    kv, prefix, daemon = stats["kv_cache"], stats["prefix_cache"], stats["daemon"]
    total = kv["total_blocks"]
    print(f"KV cache      {kv['used_blocks']}/{total} blocks used ({100 * kv['used_blocks'] / total:.1f} %)")
    if len(kv["groups"]) > 1:  # the layers' KV in groups: say what each holds
        held = ", ".join(
            f"{g['used_blocks']} ({f'window {w}' if (w := g['window']) else 'full'})" for g in kv["groups"]
        )
        print(f"KV groups     {held}")
    print(f"prefix cache  {100 * prefix['hit_rate']:.1f} % hit rate ({prefix['hit_tokens']} tokens reused)")
    print(f"requests      {stats['num_running']} running, {stats['num_waiting']} waiting")
    if (spec := stats["speculative"]) is not None:
        drafted, accepted = spec["num_draft_tokens"], spec["num_accepted_tokens"]
        print(
            f"speculative   {accepted}/{drafted} draft tokens accepted "
            f"({spec['mean_accepted_length']:.2f} a verification)"
        )
    print(f"throughput    {stats['generation_tokens_per_s_1m']:.1f} tokens/s (last minute)")
    print(f"clients       {daemon['num_clients']} active; {daemon['requests_total']} requests since start")
    return 0


def _top(args: argparse.Namespace) -> int:
    from kvd.top import run

    with _connect(args) as client:
        run(client, args.interval, args.once, model=args.model)
    return 0


def _models(args: argparse.Namespace) -> int:
    with _connect(args) as client:
        for model in client.list_models():
            state = "loaded" if model["loaded"] else "loading" if model["loading"] else "not loaded"
            pinned = ", pinned" if model["pinned"] else ""
            context = f", max_model_len {model['max_model_len']}" if model["loaded"] else ""
            print(f"{model['name']:24s} {state}{pinned}{context}")
    return 0


def _load(args: argparse.Namespace) -> int:
    with _connect(args) as client:
        model = client.load(args.name, args.keep_alive)
    print(f"{model['name']}: loaded, max_model_len {model['max_model_len']}")
    return 0


def _unload(args: argparse.Namespace) -> int:
    with _connect(args) as client:
        now = client.unload(args.name)
    print(f"{args.name}: {'unloaded' if now else 'unloads once nothing is in flight for it'}")
    return 0


def _tokenize(args: argparse.Namespace) -> int:
    with _connect(args) as client:
        token_ids = client.tokenize(args.text, model=args.model)
    print(" ".join(map(str, token_ids)))
    print(f"{len(token_ids)} tokens", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
