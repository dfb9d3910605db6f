"""`make demo`, the README's main job: a daemon on the bundled model, a two-turn chat, a clean stop."""

from daemon_fixtures import run_demo


def test_demo_chats_with_the_bundled_model_and_stops_cleanly():
    out, replies, cached = run_demo()
    assert "Connected: SmolLM2-135M-Instruct" in out
    assert len(replies) == 2 and all(r.strip() for r in replies)
    # The second turn repeats the first as its prefix: the cache must serve part of it.
    assert cached[0] == 0 and cached[1] > 0
    assert "exit status 0" in out
