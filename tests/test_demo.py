"""`make demo`, the README's main job: a daemon on the bundled model, a two-turn chat, a clean stop."""

import re
import subprocess
import sys

from daemon_fixtures import REPO, daemon_env


def test_demo_chats_with_the_bundled_model_and_stops_cleanly():
    done = subprocess.run(
        [sys.executable, "-m", "kvd.demo"],
        cwd=REPO,
        env=daemon_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "Connected: SmolLM2-135M-Instruct" in out
    replies = re.findall(r"^assistant: (.+)$", out, flags=re.MULTILINE)
    assert len(replies) == 2 and all(r.strip() for r in replies)
    # The second turn repeats the first as its prefix: the cache must serve part of it.
    cached = [int(n) for n in re.findall(r"(\d+) of them from the prefix cache", out)]
    assert cached[0] == 0 and cached[1] > 0
    assert "exit status 0" in out
