"""Several models in one daemon: `--model NAME=PATH` (repeatable) and `--models-dir`, each request routed by
its `model` field to its model's engine, `list_models`, typed errors for a missing or unknown model, and the
gateway's OpenAI and Ollama routes listing and serving every model."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from daemon_fixtures import REPO, DaemonProcess, daemon_env, start_daemon
from gateway_fixtures import gateway_daemon
from tiny_models import save_tiny_llama, save_tiny_reasoning_llama

from kvd.server.model_specs import ModelSpec, model_specs
from kvd_client import BadRequestError, Client, DaemonError, ModelNotFoundError

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def daemon(tiny_daemon_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    folder = tmp_path_factory.mktemp("models")
    save_tiny_reasoning_llama(folder / "thinker")
    save_tiny_llama(folder / "plain")
    (folder / "broken").mkdir()
    (folder / "broken" / "config.json").write_text('{"architectures": ["NoSuchModel"]}')
    (folder / "notes.txt").write_text("not a model")  # passed over
    args = ("--model", f"smol={tiny_daemon_model}", "--models-dir", str(folder), "--max-loaded-models", "2")
    with gateway_daemon(None, tmp_path_factory.mktemp("multi"), *args) as proc:
        yield proc


@pytest.fixture(scope="module")
def kvd(daemon: DaemonProcess) -> Iterator[Client]:
    with daemon.client() as client:
        yield client


NAMES = ["smol", "broken", "plain", "thinker"]


def _loaded(kvd: Client) -> list[str]:
    return [m["name"] for m in kvd.list_models() if m["loaded"]]


def test_each_request_goes_to_the_model_it_names(kvd: Client):
    models = kvd.list_models()
    assert [m["name"] for m in models] == NAMES and _loaded(kvd) == ["smol"]  # the others on demand
    assert models[0]["pinned"] and not models[3]["pinned"]
    assert kvd.info()["models"] == NAMES and kvd.info()["model"] == "smol"
    assert kvd.info("thinker")["loaded"] is False  # asking about a model does not load it
    assert kvd.load("thinker")["loaded"]
    assert kvd.info("thinker")["reasoning"] is not None and kvd.info("smol")["reasoning"] is None
    # Two tokenizers: the same text has other ids in each.
    assert kvd.tokenize("Hello there", model="smol") != kvd.tokenize("Hello there", model="thinker")
    ids = kvd.tokenize("Hello there", model="thinker")
    assert kvd.detokenize(ids, model="thinker") == "Hello there"
    thinker = kvd.chat(HI, model="thinker", max_tokens=6, temperature=0)
    smol = kvd.chat(HI, model="smol", max_tokens=6, temperature=0)
    assert thinker.reasoning and not smol.reasoning  # the thinker's template opens a section
    assert kvd.chat(HI, model="smol", max_tokens=6, temperature=0).token_ids == smol.token_ids
    assert kvd.embed("Hello", model="thinker").dimensions == kvd.info("thinker")["hidden_size"]
    assert set(kvd.stats()["models"]) == {"smol", "thinker"} and _loaded(kvd) == ["smol", "thinker"]


def test_streams_to_two_models_run_side_by_side(daemon: DaemonProcess):
    results: dict[str, list] = {}

    def run(name: str) -> None:
        with daemon.client() as client:
            results[name] = list(client.stream("Once upon a time", model=name, max_tokens=24, temperature=0))

    threads = [threading.Thread(target=run, args=(name,)) for name in ("smol", "thinker")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    with daemon.client() as client:
        for name in ("smol", "thinker"):
            alone = client.generate("Once upon a time", model=name, max_tokens=24, temperature=0)
            assert [t for c in results[name] for t in c.token_ids] == alone.token_ids


def test_a_missing_or_unknown_model_is_a_typed_error(kvd: Client):
    with pytest.raises(BadRequestError) as e:
        kvd.chat(HI, max_tokens=2)
    assert e.value.field == "model" and ", ".join(NAMES) in e.value.message
    with pytest.raises(ModelNotFoundError) as e:
        kvd.generate("x", model="llama-70b", max_tokens=2)
    assert e.value.field == "model" and "llama-70b" in e.value.message
    with pytest.raises(ModelNotFoundError):
        kvd.info("llama-70b")
    with pytest.raises(BadRequestError) as e:
        kvd.tokenize("x", model=7)
    assert e.value.field == "model"
    assert kvd.chat(HI, model="smol", max_tokens=2).finish_reason in ("length", "stop")  # still serving


def test_the_gateway_lists_and_serves_every_model(daemon: DaemonProcess):
    oai = openai.OpenAI(base_url=f"{daemon.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in oai.models.list()] == NAMES
    thinker = oai.chat.completions.create(model="thinker", messages=HI, max_tokens=6, temperature=0)
    smol = oai.chat.completions.create(model="smol", messages=HI, max_tokens=6, temperature=0)
    assert thinker.choices[0].message.model_extra.get("reasoning_content")
    assert "reasoning_content" not in smol.choices[0].message.model_extra
    assert (thinker.model, smol.model) == ("thinker", "smol")
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="gpt-5", messages=HI, max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "'smol', 'broken'" in e.value.body["message"]
    tags = httpx.get(f"{daemon.base_url}/api/tags", timeout=30).json()
    assert [m["name"] for m in tags["models"]] == [f"{name}:latest" for name in NAMES]
    reply = httpx.post(
        f"{daemon.base_url}/api/chat",
        json={"model": "thinker:latest", "messages": HI, "stream": False, "options": {"num_predict": 4}},
        timeout=60,
    ).json()
    assert reply["message"]["thinking"]
    # Ollama's running models with what each holds: its weights and KV pool (list_models' bytes).
    ps = httpx.get(f"{daemon.base_url}/api/ps", timeout=30).json()["models"]
    with daemon.client() as client:
        sizes = {m["name"]: m["bytes"] for m in client.list_models() if m["loaded"]}
    assert {m["name"]: m["size"] for m in ps} == {f"{name}:latest": size for name, size in sizes.items()}
    metrics = httpx.get(f"{daemon.base_url}/metrics", timeout=30).text
    for name in ("smol", "thinker"):  # each loaded model's engine, labelled
        assert f'kvd_running_sequences{{model="{name}"}}' in metrics


def test_loads_on_demand_once_evicts_the_least_recent_idle_model_and_keeps_alive(
    daemon: DaemonProcess, kvd: Client
):
    kvd.chat(HI, model="thinker", max_tokens=2)
    assert _loaded(kvd) == ["smol", "thinker"]
    # Two first requests for "plain" at once: one load; the idle thinker makes room (two loaded at most).
    replies: list = []
    threads = [
        threading.Thread(target=lambda: replies.append(_chat_in_own_client(daemon, "plain")))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(replies) == 2 and replies[0].token_ids == replies[1].token_ids
    assert daemon.log().count("loading model plain") == 1
    assert _loaded(kvd) == ["smol", "plain"]
    # keep_alive 0: unloaded once the reply is out.
    kvd.chat(HI, model="thinker", max_tokens=2, keep_alive=0)
    _wait_for(lambda: _loaded(kvd) == ["smol"])
    assert kvd.load("plain", keep_alive="10m")["loaded"] and _loaded(kvd) == ["smol", "plain"]
    assert kvd.unload("plain") and _loaded(kvd) == ["smol"]
    with pytest.raises(BadRequestError) as e:
        kvd.unload("smol")
    assert "pinned" in e.value.message
    with pytest.raises(BadRequestError) as e:
        kvd.chat(HI, model="plain", max_tokens=2, keep_alive="soon")
    assert e.value.field == "keep_alive"


def test_a_model_that_fails_to_load_fails_its_requests_alone(kvd: Client):
    with pytest.raises(DaemonError) as e:
        kvd.chat(HI, model="broken", max_tokens=2)
    assert "model broken failed to load" in e.value.message and e.value.field == "model"
    assert not kvd.list_models()[1]["loaded"]
    assert kvd.chat(HI, model="smol", max_tokens=2).token_ids  # the others serve on


def _chat_in_own_client(daemon: DaemonProcess, model: str):
    with daemon.client(timeout=120) as client:
        return client.chat(HI, model=model, max_tokens=4, temperature=0)


def _wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_model_specs_name_sources_and_find_a_folders_models(tmp_path: Path):
    assert model_specs(["a=/x/y", "/p/q=r", "org/model"], None) == [
        ModelSpec("a", "/x/y"),
        ModelSpec(None, "/p/q=r"),  # not a name before the "=": all of it is the source
        ModelSpec(None, "org/model"),
    ]
    assert model_specs([], None) == [ModelSpec(None, None)]  # the bundled default
    (tmp_path / "b.gguf").write_bytes(b"")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    assert model_specs([], str(tmp_path)) == [
        ModelSpec("a", str(tmp_path / "a")),
        ModelSpec("b", str(tmp_path / "b.gguf")),
    ]
    with pytest.raises(FileNotFoundError, match=r"no \.gguf file or model folder"):
        model_specs([], str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="no such folder"):
        model_specs([], str(tmp_path / "nowhere"))


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--tensor-parallel-size", "2"], "serves one model"),
        (["--pin", "c"], "--pin c: no model has that name; served: a, b"),
        (["--pin", "b", "--max-loaded-models", "1"], "2 models are pinned"),
    ],
)
def test_serve_refuses_impossible_model_settings_before_loading(flags: list[str], says: str):
    cmd = [sys.executable, "-m", "kvd.cli", "serve", "--model", "a=x", "--model", "b=y", *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=daemon_env(), timeout=120)
    assert done.returncode == 2 and says in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("table", "says"),
    [
        ('path = "x"\nblock_size = 32', "models[0]: block_size cannot be set per model"),
        ('name = "a"', "models[0] needs a path"),
        ('path = "x"\nkv_cache_memory = "lots"', "models[0].kv_cache_memory"),
        ('path = "x"\npinned = "yes"', "models[0].pinned must be true or false"),
    ],
)
def test_a_config_files_model_tables_are_checked_before_loading(tmp_path: Path, table: str, says: str):
    config = tmp_path / "kvd.toml"
    config.write_text(f"[[models]]\n{table}\n")
    cmd = [sys.executable, "-m", "kvd.cli", "serve", "--config", str(config)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=daemon_env(), timeout=120)
    assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_each_model_of_a_config_file_has_its_own_settings(tmp_path: Path):
    """[[models]] tables: a model pinned with its own context and dtype beside one with the daemon's."""
    folder = tmp_path / "models"
    for name in ("first", "small"):
        save_tiny_llama(folder / name)
    config = tmp_path / "kvd.toml"
    config.write_text(
        f'model = "{folder / "first"}"\n'
        "[[models]]\n"
        f'name = "small"\npath = "{folder / "small"}"\n'
        'max_model_len = 64\ndtype = "bfloat16"\nkv_cache_memory = "2M"\npinned = true\n'
    )
    daemon = start_daemon(tmp_path, "--config", str(config))
    try:
        with daemon.client() as client:
            assert _loaded(client) == ["first", "small"]  # pinned: loaded at start
            small, first = client.info("small"), client.info("first")
            assert (small["max_model_len"], small["dtype"]) == (64, "bfloat16")
            assert first["max_model_len"] > 64 and first["dtype"] == "float32"
            assert client.chat(HI, model="small", max_tokens=2).token_ids
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_a_request_for_one_model_does_not_wait_behind_the_same_clients_for_another(tmp_path: Path):
    """One client: a long generation fills model a's engine (one sequence at most), a second for a waits; its
    request for b runs meanwhile (admission takes a client's oldest generation for each model)."""
    for name in ("a", "b"):
        save_tiny_llama(tmp_path / name)
    flags = ["--model", f"a={tmp_path / 'a'}", "--model", f"b={tmp_path / 'b'}", "--pin", "b"]
    daemon = start_daemon(tmp_path, *flags, "--max-num-seqs", "1")
    try:
        with daemon.client(timeout=60) as client:
            long = client.stream_chat(HI, model="a", max_tokens=3000, ignore_eos=True)
            assert next(iter(long)).token_ids  # a's engine holds it
            waiting = client.stream_chat(HI, model="a", max_tokens=2, ignore_eos=True)
            assert client.chat(HI, model="b", max_tokens=2, ignore_eos=True).token_ids
            assert client.stats("a")["num_running"] == 1  # b's reply came while the long one still runs
            long.close()  # aborts it: the waiting one runs
            assert len([t for chunk in waiting for t in chunk.token_ids]) == 2
    finally:
        assert daemon.stop() == 0, daemon.log()


def _kvd(daemon: DaemonProcess, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kvd.cli", *args, "--endpoint", daemon.endpoint]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=daemon_env(), timeout=120)


def test_the_cli_lists_loads_and_unloads_models(daemon: DaemonProcess, kvd: Client):
    kvd.unload("thinker")
    listed = _kvd(daemon, "models").stdout.splitlines()
    assert [line.split()[0] for line in listed] == NAMES and "loaded, pinned" in listed[0]
    assert "not loaded" in _kvd(daemon, "info", "--model", "thinker").stdout
    assert "thinker: loaded, max_model_len" in _kvd(daemon, "load", "thinker", "--keep-alive", "1h").stdout
    assert "reasoning" in _kvd(daemon, "info", "--model", "thinker", "--json").stdout
    assert _kvd(daemon, "tokenize", "Hi", "--model", "thinker").stdout.split() == list(
        map(str, kvd.tokenize("Hi", model="thinker"))
    )
    assert "thinker: unloaded" in _kvd(daemon, "unload", "thinker").stdout
    refused = _kvd(daemon, "unload", "smol")
    assert refused.returncode != 0 and "pinned" in refused.stderr


def test_a_key_that_names_its_models_sees_and_uses_those_alone(daemon: DaemonProcess, tmp_path: Path):
    from test_gateway_security import ALICE, BOB, running_gateway

    keys = tmp_path / "keys"
    keys.write_text(f"alice:{ALICE} models=smol\nbob:{BOB}\n")
    keys.chmod(0o600)
    with running_gateway(daemon, tmp_path, "--api-key-file", str(keys)) as base_url:
        alice = openai.OpenAI(base_url=f"{base_url}/v1", api_key=ALICE, max_retries=0, timeout=60)
        bob = openai.OpenAI(base_url=f"{base_url}/v1", api_key=BOB, max_retries=0, timeout=60)
        assert [m.id for m in alice.models.list()] == ["smol"]
        assert [m.id for m in bob.models.list()] == NAMES
        assert alice.chat.completions.create(model="smol", messages=HI, max_tokens=2).choices
        with pytest.raises(openai.NotFoundError) as e:  # as if it were not served: no hint it exists
            alice.chat.completions.create(model="thinker", messages=HI, max_tokens=2)
        assert (
            e.value.body["code"] == "model_not_found"
            and "thinker" not in e.value.body["message"].split(";")[1]
        )
        assert bob.chat.completions.create(model="plain", messages=HI, max_tokens=2).choices
