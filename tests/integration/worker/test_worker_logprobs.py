"""Log probabilities from a real worker, through the official `openai` client and SGLang's
`/generate`, against an independent reference: log_softmax of HF transformers' (and PEFT's)
logits on the same checkpoint, for the same tokens."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from workerkit import WorkerProcess, start_worker

pytestmark = pytest.mark.integration

TOL = 2e-4  # float32 checkpoint, float32 logprobs on both sides


@pytest.fixture(scope="module")
def adapter_dir(make_adapter_dir: Callable[..., Path]) -> Path:
    return make_adapter_dir("scored", seed=3)


@pytest.fixture(scope="module", params=["in-turn", "overlap", "in-thread"])
def worker(
    request: pytest.FixtureRequest,
    tiny_model: Path,
    adapter_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[WorkerProcess]:
    # steps taken in turn or overlapped (ADR 0014); the engine in its core process or on a
    # thread of the front end's (ADR 0012)
    extra = {"in-turn": ["--no-overlap"], "overlap": [], "in-thread": ["--no-engine-process"]}[
        request.param
    ]
    process = start_worker(
        tiny_model,
        tmp_path_factory.mktemp("logprobs"),
        "--allowed-lora-root",
        str(adapter_dir.parent),
        "--max-model-len",
        "96",
        "--lora",
        f"scored={adapter_dir}",
        *extra,
    )
    yield process
    process.stop()


@pytest.fixture(scope="module")
def reference(tiny_model: Path, adapter_dir: Path) -> Callable[[list[int], bool], torch.Tensor]:
    """``[len(ids), vocab]`` reference logprobs of ``ids`` (base model, or with the adapter)."""
    from loraplane.worker.check.reference import load_hf, load_peft, sequence_logprobs

    models = {
        False: load_hf(tiny_model, "float32", "cpu"),
        True: load_peft(tiny_model, adapter_dir, "float32", "cpu"),
    }

    def logprobs(ids: list[int], with_adapter: bool) -> torch.Tensor:
        return sequence_logprobs(models[with_adapter], ids, "cpu")

    return logprobs


def client(worker: WorkerProcess) -> Any:
    import openai

    return openai.OpenAI(base_url=worker.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tok(tiny_model: Path) -> Any:
    """The worker's own tokenizer (prompts' token ids, as it encodes them)."""
    from loraplane.worker.engine.tokenizer import TextTokenizer

    return TextTokenizer(str(tiny_model))


def greedy_ids(
    worker: WorkerProcess, prompt_ids: list[int], adapter: str | None, n: int
) -> list[int]:
    """The ids a greedy request generates (through /generate, which returns them)."""
    body = {
        "input_ids": prompt_ids,
        "lora_path": adapter,
        "sampling_params": {"max_new_tokens": n, "temperature": 0},
    }
    r = worker.client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return list(r.json()["output_ids"])


def generated_tokens(worker: WorkerProcess, adapter: str) -> float:
    """The worker's ``loraplane_worker_generated_tokens_total`` for ``adapter``."""
    for line in worker.client.get("/metrics").text.splitlines():
        if line.startswith("loraplane_worker_generated_tokens_total{") and (
            f'adapter="{adapter}"' in line
        ):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def check_top(
    top: list[tuple[int, float]], ref_row: torch.Tensor, count: int, sampled: int | None
) -> None:
    """``top`` are the ``count`` likeliest tokens of ``ref_row``, sorted, with its logprobs."""
    assert len(top) == count
    values = [lp for _, lp in top]
    assert values == sorted(values, reverse=True)
    for token, lp in top:
        assert abs(lp - float(ref_row[token])) < TOL, (token, lp, float(ref_row[token]))
    kth = float(ref_row.topk(count).values[-1])
    assert min(values) >= kth - TOL
    if sampled is not None:  # greedy: the sampled token is the likeliest
        assert sampled in [t for t, _ in top]


@pytest.mark.parametrize("model", ["tiny-llama", "scored"])
def test_completion_logprobs_match_the_reference(
    worker: WorkerProcess, reference: Callable[..., torch.Tensor], tok: Any, model: str
) -> None:
    prompt = "The quick brown fox"
    done = client(worker).completions.create(
        model=model, prompt=prompt, max_tokens=5, temperature=0, logprobs=3
    )
    choice = done.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs is not None
    prompt_ids = tok.encode(prompt)
    ids = greedy_ids(worker, prompt_ids, None if model == "tiny-llama" else model, 5)
    ref = reference(prompt_ids + ids, model != "tiny-llama")
    assert len(lp.token_logprobs) == len(ids) == done.usage.completion_tokens  # type: ignore[union-attr]
    for i, token in enumerate(ids):
        row = ref[len(prompt_ids) - 1 + i]
        assert abs(lp.token_logprobs[i] - float(row[token])) < TOL
        top = lp.top_logprobs[i]
        assert top is not None and lp.tokens[i] in top
        # the 3 likeliest by the reference (fewer where two tokens share a text: a dict),
        # and the greedy token is the likeliest
        best = row.topk(3).values.tolist()
        assert 1 <= len(top) <= 3
        assert all(any(abs(v - b) < TOL for b in best) for v in top.values()), (top, best)
        assert top[lp.tokens[i]] == pytest.approx(best[0], abs=TOL)
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_echo_with_no_tokens_scores_the_prompt(
    worker: WorkerProcess, reference: Callable[..., torch.Tensor], tok: Any
) -> None:
    """What evaluation harnesses (lm-eval's loglikelihood) send: token ids, echo, max_tokens 0."""
    prompt_ids = tok.encode("Paris is the capital of France")
    generated = generated_tokens(worker, "scored")
    done = client(worker).completions.create(
        model="scored", prompt=prompt_ids, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    assert generated_tokens(worker, "scored") == generated  # scored, nothing generated
    choice = done.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == len(prompt_ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = reference(prompt_ids, True)
    for i in range(1, len(prompt_ids)):
        assert abs(lp.token_logprobs[i] - float(ref[i - 1, prompt_ids[i]])) < TOL
        top = lp.top_logprobs[i]
        assert top is not None and lp.tokens[i] in top
        assert max(top.values()) == pytest.approx(float(ref[i - 1].max()), abs=TOL)
    assert done.usage is not None and done.usage.completion_tokens == 0
    assert choice.finish_reason == "length"
    assert choice.text == "".join(lp.tokens)


def test_echo_with_tokens_scores_the_prompt_then_the_completion(
    worker: WorkerProcess, reference: Callable[..., torch.Tensor], tok: Any
) -> None:
    prompt = "Once upon a time"
    prompt_ids = tok.encode(prompt)
    done = client(worker).completions.create(
        model="tiny-llama", prompt=prompt, max_tokens=3, echo=True, logprobs=2, temperature=0
    )
    choice = done.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.tokens is not None
    assert choice.text.startswith(prompt)
    assert len(lp.token_logprobs) == len(prompt_ids) + 3
    ids = prompt_ids + greedy_ids(worker, prompt_ids, None, 3)
    ref = reference(ids, False)
    assert lp.token_logprobs[0] is None
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - float(ref[i - 1, ids[i]])) < TOL
    # echo without logprobs: the text alone
    plain = client(worker).completions.create(
        model="tiny-llama", prompt=prompt, max_tokens=3, echo=True, temperature=0
    )
    assert plain.choices[0].text == choice.text and plain.choices[0].logprobs is None


def test_chat_logprobs_match_the_reference(
    worker: WorkerProcess, reference: Callable[..., torch.Tensor], tok: Any
) -> None:
    messages = [{"role": "user", "content": "Say hi"}]
    done = client(worker).chat.completions.create(
        model="scored", messages=messages, max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=4,
    )  # fmt: skip
    content = done.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == done.usage.completion_tokens  # type: ignore[union-attr]
    prompt_ids = tok.apply_chat_template(messages)
    ids = greedy_ids(worker, prompt_ids, "scored", 4)
    ref = reference(prompt_ids + ids, True)
    for i, entry in enumerate(content):
        row = ref[len(prompt_ids) - 1 + i]
        assert entry.token == tok.decode([ids[i]])
        assert abs(entry.logprob - float(row[ids[i]])) < TOL
        assert entry.bytes == list(entry.token.encode())
        # the alternatives: the reference's 4 likeliest, sorted, the greedy token first
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx(row.topk(4).values.tolist(), abs=TOL)
        assert entry.top_logprobs[0].token == entry.token
    assert "".join(e.token for e in content) == done.choices[0].message.content


def test_streamed_chunks_carry_each_tokens_logprobs(worker: WorkerProcess) -> None:
    c = client(worker)
    whole = c.completions.create(
        model="scored", prompt="The quick brown fox", max_tokens=5, temperature=0, logprobs=2
    )
    chunks = list(
        c.completions.create(
            model="scored",
            prompt="The quick brown fox",
            max_tokens=5,
            temperature=0,
            logprobs=2,
            stream=True,
        )
    )
    streamed = [lp for ch in chunks for lp in (ch.choices[0].logprobs.token_logprobs or [])]  # type: ignore[union-attr]
    assert whole.choices[0].logprobs is not None
    assert streamed == pytest.approx(whole.choices[0].logprobs.token_logprobs, abs=1e-6)
    offsets = [o for ch in chunks for o in (ch.choices[0].logprobs.text_offset or [])]  # type: ignore[union-attr]
    assert offsets == whole.choices[0].logprobs.text_offset
    chat_whole = c.chat.completions.create(
        model="scored", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        temperature=0, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    chat_chunks = list(
        c.chat.completions.create(
            model="scored",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            stream=True,
        )
    )
    per_chunk = [
        ch.choices[0].logprobs.content
        for ch in chat_chunks
        if ch.choices and ch.choices[0].logprobs
    ]
    # each chunk its own tokens' (several where events queued up behind the stream)
    assert len(per_chunk) > 1 and all(entries for entries in per_chunk)
    got = [(e.token, e.logprob) for entries in per_chunk for e in entries or []]
    want = [(e.token, e.logprob) for e in chat_whole.choices[0].logprobs.content or []]  # type: ignore[union-attr]
    assert got == [(t, pytest.approx(v, abs=1e-6)) for t, v in want]


def test_logprobs_are_the_models_not_the_samplers(
    worker: WorkerProcess, reference: Callable[..., torch.Tensor], tok: Any
) -> None:
    """At temperature 5 with top_k 2 the logprobs are still the model's own distribution."""
    prompt_ids = tok.encode("Hello")
    r = worker.client.post(
        "/v1/completions",
        json={"model": "tiny-llama", "prompt": prompt_ids, "max_tokens": 1, "temperature": 5.0,
              "top_k": 2, "seed": 7, "logprobs": 0},
    )  # fmt: skip
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    # the sampled token's id: the same seeded request through /generate
    ids = worker.client.post(
        "/generate",
        json={"input_ids": prompt_ids, "sampling_params": {"max_new_tokens": 1,
              "temperature": 5.0, "top_k": 2, "seed": 7}},
    ).json()["output_ids"]  # fmt: skip
    ref = reference(prompt_ids, False)
    assert lp["token_logprobs"][0] == pytest.approx(float(ref[-1, ids[0]]), abs=TOL)
    assert list(lp["top_logprobs"][0]) == lp["tokens"]  # logprobs 0: the token itself only


def test_sglang_return_logprob_has_sglangs_shape(
    worker: WorkerProcess, reference: Callable[..., torch.Tensor], tok: Any
) -> None:
    prompt_ids = tok.encode("The quick brown fox")
    body = {
        "input_ids": prompt_ids,
        "lora_path": "scored",
        "sampling_params": {"max_new_tokens": 3, "temperature": 0},
        "return_logprob": True,
        "top_logprobs_num": 2,
        "logprob_start_len": 0,
        "return_text_in_logprobs": True,
    }
    r = worker.client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    meta, ids = out["meta_info"], out["output_ids"]
    ref = reference(prompt_ids + ids, True)
    inputs = meta["input_token_logprobs"]
    assert [t[1] for t in inputs] == prompt_ids and inputs[0][0] is None
    for i in range(1, len(prompt_ids)):
        assert abs(inputs[i][0] - float(ref[i - 1, prompt_ids[i]])) < TOL
        assert isinstance(inputs[i][2], str)
    outputs = meta["output_token_logprobs"]
    assert [t[1] for t in outputs] == ids
    for i, (lp, token, _text) in enumerate(outputs):
        assert abs(lp - float(ref[len(prompt_ids) - 1 + i, token])) < TOL
    assert meta["input_top_logprobs"][0] is None
    for i, top in enumerate(meta["output_top_logprobs"]):
        check_top([(t[1], t[0]) for t in top], ref[len(prompt_ids) - 1 + i], 2, ids[i])
    # the default start (-1): the prompt's last token only; no text unless asked
    body.update(logprob_start_len=-1, return_text_in_logprobs=False, top_logprobs_num=0)
    meta = worker.client.post("/generate", json=body).json()["meta_info"]
    assert [t[1:] for t in meta["input_token_logprobs"]] == [[prompt_ids[-1], None]]
    assert "input_top_logprobs" not in meta
    # streamed: cumulative, as the text is
    body["stream"] = True
    with worker.client.stream("POST", "/generate", json=body) as s:
        frames = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    last = frames[-1]["meta_info"]["output_token_logprobs"]
    assert [t[1] for t in last] == ids
    assert all(math.isfinite(t[0]) for t in last)
    # without return_logprob, meta_info is as before
    plain = worker.client.post("/generate", json={"text": "hi"}).json()["meta_info"]
    assert "output_token_logprobs" not in plain


BAD = [
    ("/v1/completions", {"prompt": "hi", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "echo": "yes"}, "echo"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        "top_logprobs",
    ),
    ("/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
    ("/generate", {"text": "hi", "top_logprobs_num": 2}, "top_logprobs_num"),
    ("/generate", {"text": "hi", "return_logprob": True, "logprob_start_len": 99}, "logprob_start_len"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "field"), BAD)
def test_bad_logprob_values_are_refused_naming_the_field(
    worker: WorkerProcess, path: str, body: dict[str, Any], field: str
) -> None:
    r = worker.client.post(path, json=body)
    assert r.status_code in (400, 422), r.text
    error = r.json()["error"]
    assert error["param"] is not None and error["param"].endswith(field), error
    assert field in error["message"], error
