"""The C client (clients/c) against a real daemon: the Python client's greedy output, errors, no daemon."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import jsonschema
import msgpack
import pytest
import zmq
from client_parity import (
    ERROR_CASES,
    GREEDY_REQUESTS,
    NO_DAEMON_TIMEOUT_MS,
    assert_error,
    assert_same_completion,
    assert_timed_out,
    error_case,
    python_completion,
    run_with_localhost_on_ipv6,
    run_with_planted_tmp,
    stale_socket,
)
from daemon_fixtures import REPO, DaemonProcess, ipv6_loopback_or_refusal, raw_socket, recv_reply, tcp_daemon
from tool_fixtures import SCHEMAS, TOOLS

from kvd_client import EndpointError, resolve_endpoint
from kvd_client.endpoint import check_private_dir

C_DIR = REPO / "clients" / "c"
MALFORMED_ENDPOINTS = [
    "kvd.sock",
    "ipc://relative/kvd.sock",
    "ipc://@abstract",
    f"ipc:///{'x' * 120}",
    "tcp://127.0.0.1",
    "tcp://:80",
    "tcp://127.0.0.1:0",
    "tcp://127.0.0.1:65536",
    "tcp://127.0.0.1:http",
    "udp://h:9",
]


@pytest.fixture(scope="session")
def c_build() -> Path:
    """build/ with libkvd.a, libkvd.so, generate and test_client; make rebuilds only what changed."""
    proc = subprocess.run(["make", "-C", str(C_DIR)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"make failed (run clients/install-deps.sh?):\n{proc.stdout}\n{proc.stderr}"
    return C_DIR / "build"


def run_test_client(build: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, dict]:
    proc = subprocess.run(
        [str(build / "test_client"), *args], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def request_args(request: dict) -> list[str]:
    """test_client's flags for a protocol request."""
    args = []
    for key, value in request.items():
        if key == "prompt":
            args += ["-p", value]
        elif key == "prompt_token_ids":
            args += ["-i", ",".join(map(str, value))]
        elif key == "messages":
            for m in value:
                args += ["-m", f"{m['role']}={m['content']}"]
        elif key == "max_tokens":
            args += ["-n", str(value)]
        elif key == "temperature":
            args += ["-t", repr(value)]
        elif key == "ignore_eos":
            args += ["-E"] if value else []
        else:
            raise ValueError(f"test_client has no flag for {key!r}")
    return args


def generate(build: Path, endpoint: str, request: dict, stream: bool = False) -> tuple[int, dict]:
    flags = ["-s"] if stream else []
    return run_test_client(build, "generate", "-e", endpoint, *flags, *request_args(request))


def test_the_shared_library_exports_exactly_the_api_of_kvd_h(c_build: Path):
    declared = set(re.findall(r"^KVD_API [^(]*?\b(kvd_\w+)\(", (C_DIR / "kvd.h").read_text(), re.M))
    assert {"kvd_connect", "kvd_generate", "kvd_abort", "kvd_close", "kvd_set_timeout"} <= declared
    symbols = subprocess.run(
        ["nm", "-D", "--defined-only", str(c_build / "libkvd.so")], capture_output=True, text=True, check=True
    ).stdout
    exported = {line.split()[2] for line in symbols.splitlines() if line.split()[1] == "T"}
    assert exported == declared


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("name", GREEDY_REQUESTS)
def test_greedy_output_equals_the_python_clients(
    c_build: Path, tiny_daemon: DaemonProcess, name: str, stream: bool
):
    request = GREEDY_REQUESTS[name]
    code, result = generate(c_build, tiny_daemon.endpoint, request, stream)
    assert code == 0
    assert_same_completion(result, python_completion(tiny_daemon, request), stream)
    if stream:
        assert [c["is_final"] for c in result["chunks"]] == [False] * (len(result["chunks"]) - 1) + [True]
        assert {c["request_id"] for c in result["chunks"]} == {result["request_id"]}


def test_a_daemon_on_ipv6_loopback_serves_the_c_client(
    c_build: Path, tiny_daemon: DaemonProcess, tiny_daemon_model: Path, tmp_path: Path
):
    ipv6_loopback_or_refusal()
    request = GREEDY_REQUESTS["prompt"]
    with tcp_daemon(tmp_path, tiny_daemon_model, "[::1]") as daemon:
        results = [generate(c_build, daemon.endpoint, request, stream) for stream in (False, True)]
    reference = python_completion(tiny_daemon, request)
    for (code, result), stream in zip(results, (False, True), strict=True):
        assert code == 0, result
        assert_same_completion(result, reference, stream)


def test_a_daemon_on_localhost_is_reached_where_localhost_names_ipv6_too(
    c_build: Path, tiny_daemon_model: Path, tmp_path: Path
):
    # The daemon binds localhost in IPv4; a client in IPv6 mode would try ::1 alone and time out.
    with tcp_daemon(tmp_path, tiny_daemon_model, "localhost") as daemon:
        health = [str(c_build / "test_client"), "health", "-e", daemon.endpoint, "-T", "5000"]
        proc = run_with_localhost_on_ipv6(health, tmp_path / "hosts")
    assert proc.returncode == 0 and json.loads(proc.stdout)["health"] == "ready", proc.stdout + proc.stderr


def test_the_example_streams_the_completion_to_stdout(c_build: Path, tiny_daemon: DaemonProcess):
    reference = python_completion(
        tiny_daemon, {"prompt": "Once upon a time", "temperature": 0.0, "max_tokens": 16}
    )
    cmd = [
        str(c_build / "generate"),
        "-e",
        tiny_daemon.endpoint,
        "-n",
        "16",
        "-t",
        "0",
        "Once",
        "upon",
        "a",
        "time",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == reference["text"] + "\n"


@pytest.mark.parametrize(("flag", "value"), [("-n", "abc"), ("-n", "2.5"), ("-t", "warm"), ("-T", "")])
def test_the_example_refuses_a_flag_that_is_no_number(c_build: Path, flag: str, value: str):
    proc = subprocess.run(
        [str(c_build / "generate"), flag, value, "Hi"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and f"{flag} takes a" in proc.stderr and value in proc.stderr, proc.stderr


@pytest.mark.parametrize("name", ERROR_CASES)
def test_error_replies_surface_as_their_code(c_build: Path, tiny_daemon: DaemonProcess, name: str):
    request, error, field = error_case(tiny_daemon, name)
    for stream in (False, True):
        code, result = generate(c_build, tiny_daemon.endpoint, request, stream)
        assert code == 1
        assert_error(result, error, field)


def test_abort_from_the_callback_ends_the_generation(c_build: Path, tiny_daemon: DaemonProcess):
    request = {"prompt": "Once upon a time", "temperature": 0.0, "max_tokens": 4000, "ignore_eos": True}
    code, result = run_test_client(
        c_build, "generate", "-e", tiny_daemon.endpoint, "-s", "-a", "2", *request_args(request)
    )
    assert code == 0, result
    assert result["finish_reason"] == "abort"
    assert 2 <= result["usage"]["completion_tokens"] < 4000
    assert len(result["token_ids"]) == result["usage"]["completion_tokens"]
    with tiny_daemon.client() as client:
        stats = client.stats()
    assert stats["num_running"] + stats["num_waiting"] == 0


def test_health(c_build: Path, tiny_daemon: DaemonProcess):
    code, result = run_test_client(c_build, "health", "-e", tiny_daemon.endpoint)
    assert (code, result["status"], result["health"]) == (0, "ok", "ready")


def test_a_missing_daemon_is_a_clean_error_within_the_timeout(c_build: Path, tmp_path: Path):
    timeout = str(NO_DAEMON_TIMEOUT_MS)
    missing = f"ipc://{tmp_path}/missing.sock"
    code, result = run_test_client(c_build, "generate", "-e", missing, "-T", timeout, "-s", "-p", "Hi")
    assert code == 1
    assert_timed_out(result, "no_daemon", missing)
    stale = stale_socket(tmp_path / "stale.sock")
    code, result = run_test_client(c_build, "health", "-e", stale, "-T", timeout)
    assert code == 1
    assert_timed_out(result, "timeout", stale)


def test_the_default_endpoint_is_resolved_as_the_python_clients(
    c_build: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    settings = [
        {"KVD_ENDPOINT": None, "XDG_RUNTIME_DIR": str(tmp_path)},
        {"KVD_ENDPOINT": None, "XDG_RUNTIME_DIR": f"{tmp_path}/"},
        {"KVD_ENDPOINT": None, "XDG_RUNTIME_DIR": ""},
        {"KVD_ENDPOINT": None, "XDG_RUNTIME_DIR": None},
        {"KVD_ENDPOINT": "tcp://127.0.0.1:7000", "XDG_RUNTIME_DIR": str(tmp_path)},
    ]
    for setting in settings:
        for name, value in setting.items():
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        code, result = run_test_client(c_build, "resolve", env=dict(os.environ))
        assert (code, result["url"]) == (0, resolve_endpoint().url), setting
    code, result = run_test_client(c_build, "resolve", "-e", "ipc:///run/kvd/kvd.sock", env=dict(os.environ))
    assert result["url"] == "ipc:///run/kvd/kvd.sock"


def tmp_folders(root: Path) -> list[Path]:
    """The /tmp folder of the default endpoint as it may be found: private, missing, or planted."""
    private, target, opened = root / "private", root / "target", root / "open"
    for folder, mode in [(private, 0o700), (target, 0o700), (opened, 0o755)]:
        folder.mkdir()
        folder.chmod(mode)  # mkdir's mode is cut by the umask
    (root / "link").symlink_to(target)
    (root / "file").write_text("")
    folders = [private, root / "missing", root / "link", root / "file", opened]
    if os.geteuid() == 0:  # giving a folder to another user needs root
        (root / "theirs").mkdir(mode=0o700)
        os.chown(root / "theirs", 65534, 65534)
        folders.append(root / "theirs")
    return folders


def test_the_tmp_folder_is_checked_as_the_python_client_does(c_build: Path, tmp_path: Path):
    codes = []
    for folder in tmp_folders(tmp_path):
        try:
            check_private_dir(folder)
            expected = (0, {"status": "ok"})
        except EndpointError as e:
            expected = (1, {"status": "endpoint", "code": "endpoint", "field": "", "message": str(e)})
        assert run_test_client(c_build, "private-dir", str(folder)) == expected, folder
        codes.append(expected[0])
    assert codes[:2] == [0, 0] and all(codes[2:])  # private and missing pass, every planted one fails


def test_the_default_endpoint_refuses_a_tmp_folder_planted_by_another_user(c_build: Path):
    proc = run_with_planted_tmp([str(c_build / "test_client"), "health", "-T", "1000"])
    result = json.loads(proc.stdout)
    assert (proc.returncode, result["status"]) == (1, "endpoint"), proc.stdout + proc.stderr
    assert f"/tmp/kvd-{os.getuid()} belongs to another user (uid 65534)" in result["message"]


@pytest.mark.parametrize("url", MALFORMED_ENDPOINTS)
def test_malformed_endpoints_are_refused(c_build: Path, url: str):
    code, result = run_test_client(c_build, "generate", "-e", url, "-p", "Hi")
    assert code == 1
    assert result["status"] == "endpoint"
    assert url in result["message"]


# Structured output, logit_bias, log-probabilities, tools and embed.

ASK = ["-m", "user=What is the weather in Paris?"]


class FakeDaemon:
    """A ROUTER socket standing in for the daemon: it records the request map and answers with `reply`."""

    def __init__(self, tmp_path: Path) -> None:
        self.endpoint = f"ipc://{tmp_path}/fake.sock"
        self.socket = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(self.endpoint)

    def exchange(self, build: Path, args: list[str], reply: dict) -> tuple[dict, int, dict]:
        """Run test_client with `args`; (the request it sent, its exit status, its output)."""
        proc = subprocess.Popen(
            [str(build / "test_client"), args[0], "-e", self.endpoint, "-T", "5000", *args[1:]],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert self.socket.poll(10_000), "test_client sent nothing"
            identity, frame = self.socket.recv_multipart()
            request = msgpack.unpackb(frame)
            self.socket.send_multipart([identity, msgpack.packb({"id": request["id"], **reply})])
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode in (0, 1), err
        return request, proc.returncode, json.loads(out)

    def close(self) -> None:
        self.socket.close()


@pytest.fixture
def fake_daemon(tmp_path: Path):
    daemon = FakeDaemon(tmp_path)
    yield daemon
    daemon.close()


FAKE_FINAL = {
    "type": "final",
    "text": "",
    "token_ids": [5, 6],
    "finish_reason": "tool_calls",
    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 0},
    "logprobs": [
        {"token_id": 5, "logprob": -0.5, "top_logprobs": [[5, -0.5], [7, -1.25]]},
        {"token_id": 6, "logprob": -2.0, "top_logprobs": [[6, -2.0]]},
    ],
    "prompt_logprobs": [None, {"token_id": 9, "logprob": -3.5, "top_logprobs": [[1, -0.25]]}],
    "tool_calls": [
        {
            "id": "call_a",
            "type": "function",
            "function": {"name": "get_time", "arguments": '{"zone": "utc"}'},
        },
        {"id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
    ],
}


def test_the_new_request_fields_are_packed_as_the_protocol_says(c_build: Path, fake_daemon: FakeDaemon):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "description": 'G\u00e9t \U0001f600 "quoted"\n',
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "integer", "minimum": -3, "maximum": 1.5e3}},
                    "required": ["a"],
                    "additionalProperties": False,
                    "x": [True, False, None, 2**64 - 1, -(2**63), 0.25, {}, []],
                },
            },
        }
    ]
    args = [
        "generate",
        "-m",
        "user=hi",
        "-m",
        "assistant",
        "-K",
        'c1=f={"a": 2}',
        "-m",
        "tool=42",
        "-C",
        "c1",
    ]
    args += ["-N", "f", "-o", json.dumps(tools), "-f", "f", "-Q", "0", "-b", "5=-100", "-b", "17=2.5"]
    args += ["-L", "2", "-P", "1", "-J", '{"type": "object"}', "-O", "-r", "a+", "-g", 'start: "a"', "-s"]
    request, code, result = fake_daemon.exchange(c_build, args, FAKE_FINAL)
    assert request == {
        "v": 1,
        "id": result["request_id"],
        "op": "chat",
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 2}'}}
                ],
            },
            {"role": "tool", "content": "42", "tool_call_id": "c1", "name": "f"},
        ],
        "stream": True,
        "logit_bias": {"5": -100.0, "17": 2.5},
        "logprobs": 2,
        "prompt_logprobs": 1,
        "json_schema": '{"type": "object"}',
        "json_object": True,
        "regex": "a+",
        "grammar": 'start: "a"',
        "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "parallel_tool_calls": False,
    }
    assert code == 0 and result["status"] == "ok", result
    assert result["finish_reason"] == "tool_calls"
    assert result["tool_calls"] == [
        {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in FAKE_FINAL["tool_calls"]
    ]
    assert result["logprobs"] == FAKE_FINAL["logprobs"]
    assert result["prompt_logprobs"] == FAKE_FINAL["prompt_logprobs"]
    assert result["chunks"][-1]["logprobs"] == FAKE_FINAL["logprobs"]

    request, code, result = fake_daemon.exchange(
        c_build, ["generate", "-p", "Hi", "-c", "required", "-Q", "1"], {**FAKE_FINAL, "logprobs": None}
    )
    assert request["tool_choice"] == "required" and request["parallel_tool_calls"] is True
    assert "tools" not in request and "logit_bias" not in request
    assert result["logprobs"] is None and len(result["tool_calls"]) == 2


def test_embed_requests_and_results_on_the_wire(c_build: Path, fake_daemon: FakeDaemon):
    reply = {
        "type": "result",
        "embeddings": [[0.6, 0.8], [1.0, 0.0]],
        "dimensions": 2,
        "pooling": "mean",
        "usage": {"prompt_tokens": 4},
    }
    request, code, result = fake_daemon.exchange(
        c_build, ["embed", "-w", "hello", "-w", "world", "-d", "2"], reply
    )
    assert {k: v for k, v in request.items() if k != "id"} == {
        "v": 1,
        "op": "embed",
        "input": ["hello", "world"],
        "dimensions": 2,
    }
    assert code == 0, result
    assert [pytest.approx(v) for v in ([0.6, 0.8], [1.0, 0.0])] == result["embeddings"]
    assert (result["dimensions"], result["pooling"], result["prompt_tokens"]) == (2, "mean", 4)
    request, _, _ = fake_daemon.exchange(c_build, ["embed", "-I", "1,2,3", "-I", "4"], reply)
    assert request["input"] == [[1, 2, 3], [4]] and "dimensions" not in request
    error = {"type": "error", "code": "too_large", "field": "input[1]", "message": "too long"}
    _, code, result = fake_daemon.exchange(c_build, ["embed", "-w", "a", "-w", "b"], error)
    assert code == 1
    assert_error(result, "too_large", "input[1]")
    assert result["embeddings"] == []


@pytest.mark.parametrize(
    "text",
    [
        '[{"a": 1,}]',
        "[1 2]",
        '"\\ud800"',
        '{"a": 1} x',
        "[",
        '"a',
        "01",
        "-",
        "[1.]",
        "[" * 70 + "]" * 70,
        '"\t"',
    ],
)
def test_tools_that_are_not_json_are_refused_before_sending(c_build: Path, tmp_path: Path, text: str):
    missing = f"ipc://{tmp_path}/missing.sock"
    code, result = run_test_client(c_build, "generate", "-e", missing, "-T", "100", *ASK, "-o", text)
    assert code == 1
    assert (result["status"], result["field"]) == ("invalid_argument", "tools"), result
    assert "not valid JSON" in result["message"]


def test_constrained_outputs_match_their_regex_schema_and_grammar(c_build: Path, tiny_daemon: DaemonProcess):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
        "required": ["ok", "color"],
        "additionalProperties": False,
    }
    for seed in range(3):
        sampled = ["-t", "1.0", "-X", str(seed), "-n", "64"]
        for args in (["-p", "Name a number:"], ASK):
            code, result = generate_with(c_build, tiny_daemon, *args, *sampled, "-r", "[a-z]{2,6}-[0-9]{1,3}")
            assert code == 0, result
            assert re.fullmatch(r"[a-z]{2,6}-[0-9]{1,3}", result["text"]), result
            assert result["finish_reason"] == "stop"
            code, result = generate_with(c_build, tiny_daemon, *args, *sampled, "-J", json.dumps(schema))
            assert code == 0 and result["finish_reason"] == "stop", result
            jsonschema.validate(json.loads(result["text"]), schema)
            code, result = generate_with(c_build, tiny_daemon, *args, *sampled, "-g", 'start: "yes" | "no"')
            assert (code, result["text"], result["finish_reason"]) in ((0, "yes", "stop"), (0, "no", "stop"))
    code, result = generate_with(c_build, tiny_daemon, "-p", "Hi", "-t", "0", "-n", "24", "-O", "-s")
    assert code == 0 and result["text"].startswith("{"), result
    if result["finish_reason"] == "stop":
        assert isinstance(json.loads(result["text"]), dict)
    assert "".join(c["text"] for c in result["chunks"]) == result["text"]


def generate_with(build: Path, daemon: DaemonProcess, *args: str) -> tuple[int, dict]:
    return run_test_client(build, "generate", "-e", daemon.endpoint, *args)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["-r", "(unclosed"], "regex"),
        (["-J", '{"type": "nope"}'], "json_schema"),
        (["-J", "{not json"], "json_schema"),
        (["-g", "start: ::"], "grammar"),
        (["-r", "a", "-g", 'start: "a"'], None),
        (["-b", "-1=5"], None),
        (["-b", "5=1000"], None),
        (["-P", "99"], "prompt_logprobs"),
    ],
)
def test_bad_constraints_are_bad_requests_naming_the_field(
    c_build: Path, tiny_daemon: DaemonProcess, args: list[str], field: str | None
):
    for stream in ([], ["-s"]):
        code, result = generate_with(c_build, tiny_daemon, "-p", "Hi", *stream, *args)
        assert code == 1
        assert_error(result, "bad_request", field)
        if field is None:
            assert result["field"]
    assert generate_with(c_build, tiny_daemon, "-p", "Hi", "-n", "2")[0] == 0  # still serving


def test_logit_bias_bans_and_forces_tokens(c_build: Path, tiny_daemon: DaemonProcess):
    greedy = ["-p", "The capital of France is", "-t", "0", "-n", "4", "-E"]
    code, plain = generate_with(c_build, tiny_daemon, *greedy)
    assert code == 0
    first = plain["token_ids"][0]
    code, banned = generate_with(c_build, tiny_daemon, *greedy, "-b", f"{first}=-100")
    assert code == 0 and first not in banned["token_ids"], (plain, banned)
    code, forced = generate_with(c_build, tiny_daemon, *greedy, "-b", "504=100", "-b", f"{first}=-100")
    assert code == 0 and forced["token_ids"] == [504] * 4


def test_logprobs_and_prompt_logprobs(c_build: Path, tiny_daemon: DaemonProcess):
    with tiny_daemon.client() as client:
        prompt_ids = client.tokenize("The capital of France is")
    for stream in ([], ["-s"]):
        code, result = generate_with(
            c_build,
            tiny_daemon,
            "-p",
            "The capital of France is",
            "-t",
            "0",
            "-n",
            "6",
            "-E",
            "-L",
            "2",
            "-P",
            "3",
            *stream,
        )
        assert code == 0, result
        logprobs = result["logprobs"]
        assert [e["token_id"] for e in logprobs] == result["token_ids"]
        for entry in logprobs:
            assert entry["logprob"] <= 0 and 1 <= len(entry["top_logprobs"]) <= 3
            # Greedy: the sampled token is the best alternative.
            assert entry["top_logprobs"][0][0] == entry["token_id"]
        prompt = result["prompt_logprobs"]
        assert len(prompt) == len(prompt_ids) == result["usage"]["prompt_tokens"]
        assert prompt[0] is None
        assert [e["token_id"] for e in prompt[1:]] == prompt_ids[1:]
        assert all(e["logprob"] <= 0 and len(e["top_logprobs"]) >= 3 for e in prompt[1:])
        if stream:
            chunked = [e for c in result["chunks"] for e in c["logprobs"]]
            assert chunked == logprobs


def assert_valid_calls(result: dict, names: set[str]) -> None:
    assert result["status"] == "ok", result
    assert result["finish_reason"] == "tool_calls" and result["text"] == "", result
    assert result["tool_calls"]
    for call in result["tool_calls"]:
        assert call["name"] in names and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_required_and_named_tool_calls_parse(c_build: Path, tiny_daemon: DaemonProcess):
    # Bounded schemas and one call each: the forced output always completes, so it always parses. (Parallel calls
    # may go on until max_tokens cuts them, and then the text is incomplete: the protocol's "length".)
    tools = ["-o", json.dumps(TOOLS), "-c", "required"]
    for seed in range(3):
        for stream in ([], ["-s"]):
            sampled = ["-t", "1.0", "-X", str(seed), "-n", "200", "-Q", "0", *stream]
            code, result = generate_with(c_build, tiny_daemon, *ASK, *tools, *sampled)
            assert code == 0
            assert_valid_calls(result, {"get_weather", "get_time"})
            assert len(result["tool_calls"]) == 1
            if stream:
                assert "".join(c["text"] for c in result["chunks"]) == ""
    code, result = generate_with(c_build, tiny_daemon, *ASK, *tools, "-t", "0", "-n", "400")
    assert code == 0
    if result["finish_reason"] != "length":
        assert_valid_calls(result, {"get_weather", "get_time"})
    code, result = generate_with(
        c_build, tiny_daemon, *ASK, "-o", json.dumps(TOOLS), "-f", "get_time", "-t", "0", "-n", "120"
    )
    assert code == 0
    assert_valid_calls(result, {"get_time"})
    assert len(result["tool_calls"]) == 1  # a named function is called once


def test_a_tool_conversation_round_trip(c_build: Path, tiny_daemon: DaemonProcess):
    tools = ["-o", json.dumps(TOOLS)]
    code, result = generate_with(
        c_build, tiny_daemon, *ASK, *tools, "-c", "required", "-Q", "0", "-t", "0", "-n", "120"
    )
    assert code == 0
    call = result["tool_calls"][0]
    history = [*ASK, "-m", "assistant", "-K", f"{call['id']}={call['name']}={call['arguments']}"]
    history += ["-m", 'tool={"temp": 21}', "-C", call["id"]]
    code, reply = generate_with(c_build, tiny_daemon, *history, *tools, "-c", "none", "-t", "0", "-n", "8")
    assert code == 0, reply
    assert reply["finish_reason"] in ("stop", "length") and reply["tool_calls"] == []
    # A tool result that answers no call, and arguments that are not JSON, name the field at fault.
    code, reply = generate_with(c_build, tiny_daemon, *ASK, "-m", "tool=r", "-C", "call_x", *tools)
    assert code == 1
    assert_error(reply, "bad_request", "messages[1].tool_call_id")
    code, reply = generate_with(c_build, tiny_daemon, *ASK, "-m", "assistant", "-K", "c=f={bad", *tools)
    assert code == 1
    assert_error(reply, "bad_request", "messages[1].tool_calls[0].function.arguments")
    bad_tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}},
            },
        }
    ]
    code, reply = generate_with(c_build, tiny_daemon, *ASK, "-o", json.dumps(bad_tools))
    assert code == 1
    assert_error(reply, "bad_request", "tools[0].function.parameters")


def raw_embed(daemon: DaemonProcess, **fields) -> dict:
    """The daemon's embed result through a bare socket: the reference for the client's vectors."""
    sock = raw_socket(daemon.endpoint)
    try:
        sock.send(msgpack.packb({"v": 1, "id": 1, "op": "embed", **fields}))
        reply = recv_reply(sock, 30)
    finally:
        sock.close()
    assert reply is not None and reply["type"] == "result", reply
    return reply


def test_embed_returns_the_daemons_vectors(c_build: Path, tiny_daemon: DaemonProcess):
    texts = ["Hello world", "The capital of France is"]
    code, result = run_test_client(
        c_build, "embed", "-e", tiny_daemon.endpoint, *[a for t in texts for a in ("-w", t)]
    )
    assert code == 0, result
    reference = raw_embed(tiny_daemon, input=texts)
    assert result["dimensions"] == reference["dimensions"] == len(reference["embeddings"][0])
    assert result["pooling"] == reference["pooling"]
    assert result["prompt_tokens"] == reference["usage"]["prompt_tokens"]
    assert len(result["embeddings"]) == 2
    for vector, expected in zip(result["embeddings"], reference["embeddings"], strict=True):
        assert vector == pytest.approx(expected, abs=1e-6)  # the library keeps floats
        assert sum(x * x for x in vector) == pytest.approx(1.0, abs=1e-4)
    with tiny_daemon.client() as client:
        ids = client.tokenize(texts[0])
    code, by_ids = run_test_client(
        c_build, "embed", "-e", tiny_daemon.endpoint, "-I", ",".join(map(str, ids)), "-d", "8"
    )
    assert code == 0, by_ids
    assert by_ids["dimensions"] == 8 and len(by_ids["embeddings"][0]) == 8
    assert by_ids["embeddings"][0] == pytest.approx(
        raw_embed(tiny_daemon, input=[ids], dimensions=8)["embeddings"][0], abs=1e-6
    )
    assert sum(x * x for x in by_ids["embeddings"][0]) == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize(
    ("args", "field"), [(["-w", "ok", "-w", ""], "input[1]"), (["-w", "a", "-d", "0"], "dimensions")]
)
def test_bad_embed_inputs_name_the_field(
    c_build: Path, tiny_daemon: DaemonProcess, args: list[str], field: str
):
    code, result = run_test_client(c_build, "embed", "-e", tiny_daemon.endpoint, *args)
    assert code == 1
    assert_error(result, "bad_request", field)
