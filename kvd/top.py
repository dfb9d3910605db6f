"""`kvd top`: the daemon's load, redrawn every second (or printed once), from the `stats` op; q quits."""

from __future__ import annotations

import contextlib
import os
import select
import sys
import termios
import time
import tty
from collections.abc import Iterator
from typing import TextIO

from kvd_client import Client

CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen: plain redraw, no curses needed


def render(stats: dict, info: dict) -> str:
    """One screen: the model, totals, then one line per client with requests in flight."""
    kv, prefix, daemon = stats["kv_cache"], stats["prefix_cache"], stats["daemon"]
    total = kv["total_blocks"]
    lines = [
        f"kvd  {info['model']} ({info['dtype']}, {info['device']})  up {daemon['uptime_s']:.0f} s"
        f"{'  DRAINING' if daemon['draining'] else ''}",
        f"requests   {stats['num_running']} running, {stats['num_waiting']} waiting in the engine, "
        f"{daemon['num_queued']} queued in the daemon",
        f"KV cache   {kv['used_blocks']}/{total} blocks ({100 * kv['used_blocks'] / total:.1f} %)",
        f"prefix     {100 * prefix['hit_rate']:.1f} % hit rate",
        f"preempted  {stats['num_preemptions']}",
        f"tokens/s   {stats['generation_tokens_per_s_1m']:.1f} (last minute)",
        f"clients    {daemon['num_clients']}; {daemon['requests_total']} requests since start, "
        f"{daemon['requests_rejected']} rejected, {daemon['clients_lost']} lost",
        "",
        f"{'CLIENT':<12} {'TENANT':<12} {'REQS':>5} {'QUEUED':>6} {'ENGINE':>6} {'KV':>6} {'TOKENS':>7} {'PREEMPT':>7}",
    ]
    for c in sorted(daemon["clients"], key=lambda c: -c["requests"]):
        lines.append(
            f"{c['client'][:12]:<12} {c['tenant'][:12]:<12} {c['requests']:>5} {c['queued']:>6} "
            f"{c['in_engine']:>6} {c['kv_blocks']:>6} {c['generated_tokens']:>7} {c['preemptions']:>7}"
        )
    return "\n".join(lines)


def run(
    client: Client, interval: float, once: bool, out: TextIO | None = None, model: str | None = None
) -> None:
    """Print one screen (`once`, or when `out` is no terminal), or redraw every `interval` seconds until q (or
    Ctrl-C); `model`: which of the daemon's models (default: its first)."""
    out = out or sys.stdout  # looked up now: a caller may have replaced it
    if model:
        client.load(model)  # its load figures need it loaded
    info = client.info(model)
    if once or not out.isatty():  # into a pipe or a file: one screen, no terminal codes
        print(render(client.stats(model), info), file=out)
        return
    with _keys(sys.stdin) as pressed:
        while True:
            out.write(CLEAR + render(client.stats(model), info) + "\n(q quits)\n")
            out.flush()
            if pressed(interval) in ("q", "Q"):
                return


@contextlib.contextmanager
def _keys(stdin: TextIO) -> Iterator:
    """pressed(timeout) -> the key pressed within `timeout` seconds, or None; keys arrive unbuffered while
    the terminal is in cbreak mode (restored on the way out). Without a terminal it only waits."""
    if not stdin.isatty():
        yield lambda timeout: time.sleep(timeout)
        return
    fd = stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)
    try:
        yield (
            lambda timeout: (
                os.read(fd, 1).decode(errors="replace") if select.select([fd], [], [], timeout)[0] else None
            )
        )
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
