"""LoRA adapters: PEFT adapters made by `peft` on tiny random models, served in one batch
with the base and each other, equal HF + PEFT's greedy output in fp32 (the oracle), under
preemption, chunked prefill, prefix caching and n > 1; slots evict and reload; the native
decode step adds the same deltas as the PyTorch layers; bad adapters are refused whole."""

from __future__ import annotations

import json
import re

import pytest
import torch
from kernel_oracles import assert_same_steps
from lora_adapters import make_adapter
from tiny_models import hf_greedy, make_tiny_model

from forklift import LLM, LoRARequest, SamplingParams
from forklift.native import build as native_build

PROMPTS = [[5, 9, 33, 70, 12, 8], [17, 3, 99, 41], [7, 7, 120, 64, 31, 200, 11, 4, 90]]
NEW_TOKENS = 10


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma3"])
def tiny_with_adapters(request, tmp_path_factory):
    """A tiny base and three adapters: rank 8 on every projection, rank 4 on q and v, and an
    rsLoRA rank 2 on the MLP only."""
    directory = tmp_path_factory.mktemp(request.param)
    tiny = make_tiny_model(request.param, directory / "base")
    adapters = [
        make_adapter(tiny.hf_model, directory / "all8", 8, seed=1),
        make_adapter(tiny.hf_model, directory / "qv4", 4, ("q_proj", "v_proj"), seed=2),
        make_adapter(tiny.hf_model, directory / "mlp2", 2, ("gate_proj", "up_proj",
                     "down_proj"), seed=3, use_rslora=True),
    ]  # fmt: skip
    return tiny, adapters


def _requests(adapters) -> list[LoRARequest]:
    return [LoRARequest(f"a{i}", i + 1, str(a.path)) for i, a in enumerate(adapters)]


def _greedy(llm: LLM, prompts, loras, n: int = 1, tokens: int = NEW_TOKENS):
    params = SamplingParams(n=n, temperature=0, max_tokens=tokens, ignore_eos=True)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras
    )
    return [[o.token_ids for o in out.outputs] for out in outs]


def _engine(path, **kwargs) -> LLM:
    common = dict(model=str(path), dtype="float32", enable_lora=True, max_loras=4,
                  max_lora_rank=8, block_size=4, num_gpu_blocks_override=128,
                  max_model_len=128)  # fmt: skip
    return LLM(**{**common, **kwargs})


def test_mixed_batch_equals_hf_peft_for_every_adapter(tiny_with_adapters):
    tiny, adapters = tiny_with_adapters
    llm = _engine(tiny.path)
    loras = [None, *_requests(adapters)]
    oracles = [tiny.hf_model, *(a.hf_model for a in adapters)]
    # Every prompt under every adapter and the base, all in one batch.
    jobs = [(p, lora, oracle) for p in PROMPTS for lora, oracle in zip(loras, oracles, strict=True)]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": j[0]} for j in jobs], params, use_tqdm=False,
                        lora_request=[j[1] for j in jobs])  # fmt: skip
    first_logprobs = []
    for (prompt, _, oracle), out in zip(jobs, outs, strict=True):
        got = out.outputs[0]
        want, want_logprobs = hf_greedy(oracle, prompt, NEW_TOKENS)
        assert got.token_ids == want
        logprobs = [step[t].logprob for t, step in zip(got.token_ids, got.logprobs, strict=True)]
        assert logprobs == pytest.approx(want_logprobs, abs=1e-3)
        first_logprobs.append(round(logprobs[0], 4))
    # Each adapter changes the output (else this test could not fail).
    assert len(set(first_logprobs[:4])) == 4


def test_adapters_under_preemption_chunked_prefill_prefix_cache_and_n(tiny_with_adapters):
    tiny, adapters = tiny_with_adapters
    loras = _requests(adapters)
    long_prompt = [(7 * i + 3) % 250 + 3 for i in range(40)]
    prompts = [long_prompt, long_prompt, long_prompt[:30] + [9, 9], PROMPTS[0]]
    chosen = [loras[0], loras[1], loras[0], None]
    alone = _engine(tiny.path)
    want = [_greedy(alone, [p], [lora], n=2)[0] for p, lora in zip(prompts, chosen, strict=True)]
    # Few blocks (preemption), a small token budget (chunked prefill), two slots for three
    # distinct adapter uses, and a shared prefix under two adapters (no cross-adapter hit).
    tight = _engine(tiny.path, num_gpu_blocks_override=40, max_num_batched_tokens=16,
                    max_model_len=64, max_loras=2)  # fmt: skip
    got = _greedy(tight, prompts, chosen, n=2, tokens=NEW_TOKENS)
    assert got == want
    engine = tight.llm_engine
    assert engine.scheduler.num_preemptions > 0
    hf = hf_greedy(adapters[1].hf_model, long_prompt, NEW_TOKENS)[0]
    assert got[1] == [hf, hf]


def test_more_adapters_than_slots_evict_and_reload(tiny_with_adapters):
    tiny, adapters = tiny_with_adapters
    loras = _requests(adapters)
    llm = _engine(tiny.path, max_loras=1, max_cpu_loras=1)
    order = [loras[0], loras[1], loras[2], loras[0], None, loras[1]]
    got = _greedy(llm, [PROMPTS[0]] * len(order), order)
    for lora, outputs in zip(order, got, strict=True):
        oracle = tiny.hf_model if lora is None else adapters[lora.lora_int_id - 1].hf_model
        assert outputs[0] == hf_greedy(oracle, PROMPTS[0], NEW_TOKENS)[0]
    # One at a time: each request after the first waited for the single slot.
    assert llm.llm_engine.scheduler.lora_slots.residents() in ([1], [2], [3])


def test_update_lora_replaces_weights_and_retires_cached_blocks(tiny_with_adapters):
    tiny, adapters = tiny_with_adapters
    lora = _requests(adapters)[0]
    llm = _engine(tiny.path)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)

    def run():
        out = llm.generate([{"prompt_token_ids": PROMPTS[2]}], params, use_tqdm=False,
                           lora_request=lora)[0].outputs[0]  # fmt: skip
        steps = zip(out.token_ids, out.logprobs, strict=True)
        return out.token_ids, [step[t].logprob for t, step in steps]

    _, before = run()
    replacement = make_adapter(tiny.hf_model, adapters[0].path.parent / "other", 8, seed=11)
    from peft import get_peft_model_state_dict

    assert llm.update_lora("a0", get_peft_model_state_dict(replacement.hf_model)) == 1
    tokens, after = run()  # the prompt's cached blocks were the old adapter's: not reused
    want, want_logprobs = hf_greedy(replacement.hf_model, PROMPTS[2], NEW_TOKENS)
    assert tokens == want
    assert after == pytest.approx(want_logprobs, abs=1e-3)
    assert after[0] != pytest.approx(before[0], abs=1e-3)
    assert [info.version for info in llm.list_loras()] == [1]


@pytest.mark.skipif(native_build.find_compiler() is None, reason="no C compiler")
def test_native_step_adds_the_same_deltas_as_the_pytorch_layers(tiny_with_adapters):
    tiny, adapters = tiny_with_adapters
    loras = [None, *_requests(adapters)]
    kwargs = dict(quantization="int4", max_num_seqs=16)
    native = _engine(tiny.path, **kwargs)
    reference = _engine(tiny.path, **kwargs)
    reference.llm_engine.runner.native_step = None
    assert native.llm_engine.runner.native_step is not None
    prompts = [p for p in PROMPTS for _ in loras]
    chosen = loras * len(PROMPTS)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)

    def run(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False, lora_request=chosen)  # fmt: skip
        return [o.outputs[0] for o in outs]

    assert_same_steps(run(native), run(reference))
    assert native.llm_engine.runner.native_steps >= NEW_TOKENS - 1


def _broken_copy(adapter, tmp_path, name, *, config=None, tensors=None):
    from safetensors.torch import load_file, save_file

    target = tmp_path / name
    target.mkdir()
    base_config = json.loads((adapter.path / "adapter_config.json").read_text())
    (target / "adapter_config.json").write_text(json.dumps({**base_config, **(config or {})}))
    weights = load_file(adapter.path / "adapter_model.safetensors")
    if tensors is not None:
        weights = tensors(weights)
    save_file(weights, target / "adapter_model.safetensors")
    return str(target)


def test_bad_adapters_are_refused_naming_the_problem(tiny_with_adapters, tmp_path):
    tiny, adapters = tiny_with_adapters
    good = adapters[0]
    llm = _engine(tiny.path, max_lora_rank=4)
    first_a = next(k for k in _keys(good) if "lora_A" in k)

    def renamed(weights):
        weights["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.zeros(2, 4)
        return weights

    def truncated(weights):
        weights[first_a] = weights[first_a][:, :-1].contiguous()
        return weights

    def half(weights):
        return {k: v for k, v in weights.items() if "lora_B" not in k}

    cases = {
        "rank 8 is above max_lora_rank (4)": str(good.path),
        "use_dora": _broken_copy(adapters[1], tmp_path, "dora", config={"use_dora": True}),
        "is not a lora_A/lora_B weight": _broken_copy(adapters[1], tmp_path, "emb",
                                                      tensors=renamed),
        "lora_B is missing": _broken_copy(adapters[1], tmp_path, "half", tensors=half),
        "has no adapter_config.json": str(tmp_path),
        "is not a directory": str(tmp_path / "missing"),
    }  # fmt: skip
    small = _engine(tiny.path, max_lora_rank=8)
    for i, (message, path) in enumerate(cases.items()):
        engine = llm if "max_lora_rank" in message else small
        with pytest.raises(ValueError, match=re.escape(message)):
            engine.generate("w5 w6", SamplingParams(max_tokens=2), use_tqdm=False,
                            lora_request=LoRARequest(f"bad{i}", 50 + i, path))  # fmt: skip
        assert engine.list_loras() == []  # nothing half-loaded stays behind
        assert not engine.llm_engine.has_unfinished_requests()
    shape = _broken_copy(good, tmp_path, "shape", tensors=truncated)
    with pytest.raises(ValueError, match="do not fit the base model"):
        small.add_lora(LoRARequest("shape", 99, shape))
    base_only = LLM(str(tiny.path), dtype="float32", num_gpu_blocks_override=64, max_model_len=64)
    with pytest.raises(ValueError, match="without enable_lora"):
        base_only.generate("w5", SamplingParams(max_tokens=2), use_tqdm=False,
                           lora_request=LoRARequest("x", 1, str(good.path)))  # fmt: skip


def _keys(adapter) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(adapter.path / "adapter_model.safetensors"), "pt") as file:
        return list(file.keys())  # noqa: SIM118


def test_ids_and_names_must_agree(tiny_with_adapters):
    tiny, adapters = tiny_with_adapters
    llm = _engine(tiny.path)
    llm.add_lora(LoRARequest("one", 1, str(adapters[0].path)))
    with pytest.raises(ValueError, match="already names adapter"):
        llm.add_lora(LoRARequest("two", 1, str(adapters[1].path)))
    with pytest.raises(ValueError, match="already loaded with lora_int_id 1"):
        llm.add_lora(LoRARequest("one", 2, str(adapters[1].path)))
    assert [i.name for i in llm.list_loras()] == ["one"]
    assert llm.remove_lora("one").lora_int_id == 1
    assert llm.list_loras() == []


def test_an_id_reused_after_removal_never_reuses_the_old_adapters_cached_blocks(
    tiny_with_adapters,
):
    tiny, adapters = tiny_with_adapters
    llm = _engine(tiny.path)
    first = LoRARequest("first", 1, str(adapters[0].path))
    assert (
        _greedy(llm, [PROMPTS[2]], [first])[0][0]
        == hf_greedy(adapters[0].hf_model, PROMPTS[2], NEW_TOKENS)[0]
    )
    llm.remove_lora("first")
    second = LoRARequest("second", 1, str(adapters[1].path))  # the same id, other weights
    assert (
        _greedy(llm, [PROMPTS[2]], [second])[0][0]
        == hf_greedy(adapters[1].hf_model, PROMPTS[2], NEW_TOKENS)[0]
    )
    assert llm.llm_engine.prefix_cache_stats().hit_tokens == 0
