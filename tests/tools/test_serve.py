"""``hf-sparse-attn serve``: transformers' OpenAI-compatible server with the model patched.

Two servers run for the module, started together on free ports with a tiny random chat model
(``hf_sparse_attn.testing.chat_model``): ``bfla`` with continuous batching (the flash-named alias) and options that make
its prefill really sparse on these short prompts, and ``dense`` with sequential generation. Requests come from the
``openai`` client, ``curl`` and threads; the served tokens are compared with the patched model run in-process (and
bfla's differ from dense's on the compared prompt, so the comparison tells the methods apart). The servers are killed
in the fixture's finalizer. The command-line checks run in-process, without a server.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
if not hasattr(pytest.importorskip("transformers.cli.serving.model_manager"), "ModelLoader"):
    pytest.skip("transformers' serving package has no ModelLoader (before 5.25's layout)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 120
# bfla sparse on a 180-token prompt: no minimum length, no dense rule or rescue, 16-token tiles, 10 % of the mass.
BFLA_CONFIG = {"min_seq_len": 0, "dense_density": 1.0, "block_size": 16, "keep_mass": 0.1, "flat_entropy": 1.0,
               "local": 0, "sink": 0, "dense_last_blocks": 0}
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4
CB_OPTIONS = ["--cb-num-blocks", "64", "--cb-max-batch-tokens", "512"]  # a small KV cache: fast to allocate


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``hf-sparse-attn serve`` subprocess, its log file and its base URL."""

    def __init__(self, model: Path, log: Path, *args: str):
        self.model, self.log = str(model), log
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "hf_sparse_attn.cli", "serve", self.model, "--host", "127.0.0.1",
               "--port", str(self.port), *args]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited with {self.proc.returncode}:\n{self.log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        pytest.fail(f"the server was not ready within {READY_TIMEOUT_S} s:\n{self.log.read_text()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)

    def client(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", timeout=60, max_retries=0)

    def post(self, path: str, data: bytes) -> tuple[int, dict]:
        """Raw POST (status, JSON body or {"text": ...}), for requests the ``openai`` client would not send."""
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                status, body = r.status, r.read()
        except urllib.error.HTTPError as err:
            status, body = err.code, err.read()
        try:
            return status, json.loads(body)
        except ValueError:
            return status, {"text": body.decode(errors="replace")}


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    from hf_sparse_attn.testing.chat_model import save_tiny_chat_model

    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat") / "model")


@pytest.fixture(scope="module")
def servers(chat_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("serve-logs")
    config = [f"{k}={v}" for k, v in BFLA_CONFIG.items()]
    started = {}
    try:
        started["bfla"] = Server(chat_model, logs / "bfla.log", "--method", "bfla", "--method-config", *config,
                                 *CB_OPTIONS)
        started["dense"] = Server(chat_model, logs / "dense.log", "--method", "dense", "--no-continuous-batching")
        deadline = time.monotonic() + READY_TIMEOUT_S
        for server in started.values():
            server.wait_ready(deadline)
        yield started
    finally:
        for server in started.values():
            server.stop()


def _reference(model_dir: Path, method: str, prompt_ids: list[int], max_new_tokens: int, **config) -> list[int]:
    """Greedy tokens of the model patched in-process (sequential ``generate``)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from hf_sparse_attn import patch_model

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    patch_model(model, method=method, **config)
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=2, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), generation_config=gen)
    return out[0, len(prompt_ids):].tolist()


def test_openai_client_chat_and_completion(servers):
    for server in servers.values():
        client = server.client()
        chat = client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "Hello there"}], max_tokens=6, temperature=0
        )
        assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
        assert isinstance(chat.choices[0].message.content, str) and 1 <= chat.usage.completion_tokens <= 6
        done = client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=6, temperature=0)
        assert done.object == "text_completion" and isinstance(done.choices[0].text, str)
        assert done.usage.prompt_tokens == len("Once upon a time") and 1 <= done.usage.completion_tokens <= 6
        assert [m.id for m in client.models.list().data] == [server.model]


def test_streamed_chat_equals_the_whole_answer(servers):
    server = servers["bfla"]
    client = server.client()
    request = {"model": server.model, "messages": [{"role": "user", "content": "Tell me"}], "max_tokens": 8,
               "temperature": 0}
    whole = client.chat.completions.create(**request).choices[0].message.content
    chunks = client.chat.completions.create(**request, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole


def test_curl_chat_and_completion(servers):
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    server = servers["bfla"]
    bodies = {
        "/v1/chat/completions": {"model": server.model, "messages": [{"role": "user", "content": "Hi"}],
                                 "max_tokens": 4, "temperature": 0},
        "/v1/completions": {"model": server.model, "prompt": "Hi", "max_tokens": 4, "temperature": 0},
    }
    for path, body in bodies.items():
        out = subprocess.run(
            [curl, "-sS", "--fail-with-body", "--max-time", "60", "-H", "Content-Type: application/json",
             "-d", json.dumps(body), server.url + path],
            capture_output=True, text=True, check=True,
        )
        answer = json.loads(out.stdout)
        assert answer["object"] == ("chat.completion" if "chat" in path else "text_completion")
        assert 1 <= answer["usage"]["completion_tokens"] <= 4


def test_eight_concurrent_requests_are_all_answered(servers):
    server = servers["bfla"]
    client = server.client()

    def ask(i: int) -> tuple[str, int]:
        if i % 2:
            r = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": f"n{i}"}],
                                               max_tokens=5, temperature=0)
            return r.choices[0].message.content, r.usage.completion_tokens
        r = client.completions.create(model=server.model, prompt=f"request {i}: " + PROMPT[: 20 * i],
                                      max_tokens=5, temperature=0)
        return r.choices[0].text, r.usage.completion_tokens

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8)))
    assert len(answers) == 8
    assert all(isinstance(text, str) and 1 <= n <= 5 for text, n in answers)


def test_malformed_requests_get_errors_and_the_server_keeps_serving(servers):
    server = servers["bfla"]
    status, body = server.post("/v1/chat/completions", b'{"model": "x", "messages": [')
    assert status == 422, body  # invalid JSON: FastAPI's validation error
    ok = {"model": server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    status, body = server.post("/v1/chat/completions", json.dumps({**ok, "no_such_field": 1}).encode())
    assert status == 422 and "no_such_field" in body["detail"]
    status, body = server.post("/v1/chat/completions", json.dumps({**ok, "model": "another-model"}).encode())
    assert status == 400 and "another-model" in body["detail"]
    status, body = server.post("/v1/completions", json.dumps({"model": server.model, "prompt": 3}).encode())
    assert status == 400 and "prompt" in body["detail"]
    # A body without `messages`: transformers 5.25 answers 500 (a KeyError in its handler); the server survives it.
    status, _ = server.post("/v1/chat/completions", json.dumps({"model": server.model}).encode())
    assert status >= 400
    status, body = server.post("/v1/chat/completions", json.dumps(ok).encode())
    assert status == 200 and body["usage"]["completion_tokens"] >= 1


def test_served_tokens_are_the_patched_models(servers, chat_model):
    """Greedy completions of the prompt equal those of the model patched in-process with the same method; bfla's
    differ from dense's here, so the server really runs the sparse method (through continuous batching)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(chat_model))
    ids = tokenizer(PROMPT)["input_ids"]
    n = 12
    expected = {
        "bfla": _reference(chat_model, "bfla", ids, n, **BFLA_CONFIG),
        "dense": _reference(chat_model, "dense", ids, n),
    }
    assert expected["bfla"] != expected["dense"], "the prompt does not tell bfla from dense: the check would be void"
    for name, server in servers.items():
        done = server.client().completions.create(model=server.model, prompt=PROMPT, max_tokens=n, temperature=0)
        assert done.usage.prompt_tokens == len(ids)
        assert done.choices[0].text == tokenizer.decode(expected[name], skip_special_tokens=True), name


def test_the_log_names_method_and_attention(servers):
    logs = {name: server.log.read_text() for name, server in servers.items()}
    bfla = [line for line in logs["bfla"].splitlines() if "hf_sparse_attn:" in line and "patched" in line]
    assert len(bfla) == 1 and "method 'bfla'" in bfla[0] and "'hf_sparse_attn_flash_varlen'" in bfla[0]
    assert "'keep_mass': 0.1" in bfla[0]
    dense = [line for line in logs["dense"].splitlines() if "hf_sparse_attn:" in line and "patched" in line]
    assert len(dense) == 1 and "method 'dense'" in dense[0] and "attention implementation 'hf_sparse_attn'" in dense[0]


# --------------------------------------------------------------------------------------------------
# The command line, in-process (no server starts: every case fails before)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--method", "nope"], "--method: unknown method 'nope'"),
        (["--method-config", "keep_mass=2"], "keep_mass=2 is out of range"),
        (["--method-config", "keep_mass"], "--method-config expects key=value items, got 'keep_mass'"),
        (["--method", "entmax", "--method-config", "keep_mass=0.9"], "unknown config key 'keep_mass'"),
        (["--layers", "first"], "'first' is not allowed; allowed: 'all', 'eligible'"),
        (["tiny-llama"], "tiny random model without a tokenizer"),
        (["/no/such/folder"], "neither a local folder nor an offline alias"),
        (["--attn-implementation", "sdpa"], "--attn-implementation 'sdpa': the attention implementation is set"),
        (["--from-pretrained", "/no/such/folder"], "--from-pretrained '/no/such/folder': no hf_sparse_attn.json"),
        (["--cb-num-blocks", "many"], "argument --cb-num-blocks: invalid int value: 'many'"),
        (["--reasoning", "maybe"], "argument --reasoning: invalid choice: 'maybe'"),
    ],
)
def test_bad_arguments_are_named(argv, message, capsys):
    from hf_sparse_attn.tools.serve import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_from_pretrained_of_another_method_is_refused(tmp_path, capsys):
    from hf_sparse_attn.tools.serve import main

    (tmp_path / "hf_sparse_attn.json").write_text(json.dumps({"method": "asentmax", "config": {}}))
    with pytest.raises(SystemExit):
        main(["--method", "bfla", "--from-pretrained", str(tmp_path)])
    assert "holds parameters of method 'asentmax', not of --method 'bfla'" in capsys.readouterr().err


def test_pass_through_options_reach_transformers(monkeypatch, chat_model):
    """Options of this command and of ``transformers serve`` arrive in ``Serve`` as transformers names them."""
    from hf_sparse_attn.tools import serve, serve_loader

    seen = {}
    monkeypatch.setattr(serve_loader.PatchedServe, "__init__", lambda self, settings, **kw: seen.update(kw, s=settings))
    assert serve.main([str(chat_model), "--method", "dense", "--layers", "0", "--no-continuous-batching",
                       "--cb-num-blocks", "8", "--dtype", "float32", "--compile", "--port", "9"]) == 0
    settings = seen.pop("s")
    assert (settings.method, settings.layers, settings.continuous_batching) == ("dense", [0], False)
    assert seen == {"force_model": str(chat_model), "host": "localhost", "port": 9, "continuous_batching": False,
                    "cb_num_blocks": 8, "dtype": "float32", "compile": True}


@pytest.mark.slow
def test_smollm2_alias_is_served(tmp_path):
    """The offline alias loads from its converted folder (no hub access) and answers a chat request."""
    from hf_sparse_attn.models import alias_folders

    try:
        alias_folders("smollm2")  # converted once from the PyPI-shipped GGUF (cached)
    except ImportError as err:
        pytest.skip(str(err))
    server = Server(Path("smollm2"), tmp_path / "smollm2.log", "--method", "bfla", *CB_OPTIONS)
    server.model = "smollm2"
    try:
        server.wait_ready(time.monotonic() + 300)
        chat = server.client().chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=8, temperature=0,
        )
        assert "Paris" in chat.choices[0].message.content
    finally:
        server.stop()
