"""Runs in a subprocess with N fake CPU devices (XLA_FLAGS set by the parent before JAX starts): serves one model at
several tensor-parallel sizes and prints, as JSON on its last line, what each size generated and what its compiled
steps and arrays look like. Used by tests/parallel/test_tensor_parallel.py.

    python -m tests.parallel.tp_worker tiny8|tiny3|gemma|default|ckpt 1,2,4
    python -m tests.parallel.tp_worker tiny8_fp8 1,2        # any model case with an fp8 K/V pool (kv_cache_dtype="fp8")
    python -m tests.parallel.tp_worker tiny8_spec 1,2       # any model case speculating (1-layer self-draft, n-gram)
    python -m tests.parallel.tp_worker tiny8_split 1,2      # any model case with its sampler split from the step
                                                            # (a GPU's way), and tp 1's fused outputs beside
    python -m tests.parallel.tp_worker smol_int8 1,2        # any model case with quantization="int8"
    python -m tests.parallel.tp_worker gguf 1,2,4           # GGUF block formats kept (quantization="gguf")
    python -m tests.parallel.tp_worker tiny8_gpukernel 1,2  # any model case with the Pallas GPU layer matmul on (as
                                                            # on CUDA; the interpreter runs it), on each shard
Quantized cases multiply by XLA's dot at tp 1 too (not the native CPU kernel, whose int8 activations give other
numbers): what tensor parallelism must not change.
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np

from jaxpaged import LLM, SamplingParams
from jaxpaged.engine.beam_search import BeamSearchParams
from tests.tiny import random_params, tiny_config

ENGINE = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=8,
              precompile=False, show_progress=False)


def model(case: str):
    if case == "tiny8":  # 8 kv heads: the plain split at 2 and 4
        config = tiny_config(hidden=32, heads=8, kv_heads=8, head_dim=8, layers=2)
    elif case == "tiny3":  # SmolLM2's heads: 9 query, 3 kv (replicated and padded at 2 and 4)
        config = tiny_config(hidden=36, heads=9, kv_heads=3, head_dim=8, layers=2)
    elif case == "smol":  # SmolLM2's heads again, every matrix's K a whole number of 32-blocks per device at tp 2
        config = tiny_config(hidden=64, heads=9, kv_heads=3, head_dim=16, layers=2)
    elif case == "gguf":  # 6 query / 3 kv heads of 32 (whole blocks; replicated and padded at 2 and 4); block formats
        from jaxpaged.models.quant import is_quantized
        from tests.quant_weights import random_weight

        config = tiny_config(hidden=64, heads=6, kv_heads=3, head_dim=32, layers=2)
        params = random_params(config, seed=1)
        rng = np.random.default_rng(2)
        layers = params["layers"]
        for name, fmt in (("wq", "q4_0"), ("wk", "q8_0"), ("wv", "q4_k"), ("wo", "q4_1"), ("w_gate", "q4_k"),
                          ("w_up", "q8_0"), ("w_down", "q4_1")):
            _, k, n = layers[name].shape
            layers[name] = random_weight(rng, fmt, config.num_layers, k, n).replace(compute_dtype="float32")
        assert all(is_quantized(layers[name]) for name in ("wq", "wo", "w_down"))
        return config, params
    elif case == "gemma":  # Gemma 3: 4 query heads, 1 kv head (replicated), q/k and post norms, sliding layers
        from tests.models.gemma3_cases import engine_hf_model, ours

        return ours(engine_hf_model("softcap_scaled_untied"))
    else:
        raise ValueError(case)
    return config, random_params(config, seed=1)


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, vocab, size=20).tolist()  # a shared prefix of two full blocks: prefix caching
    return [shared + rng.integers(3, vocab, size=n).tolist() for n in (3, 9)] + \
        [rng.integers(3, vocab, size=n).tolist() for n in (5, 30)]


def generations(llm: LLM, vocab: int) -> dict:
    ps = [{"prompt_token_ids": p} for p in prompts(vocab)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    out = {}
    for name, params in (("greedy", greedy),
                         ("seeded_n2", SamplingParams(temperature=0.9, top_p=0.9, n=2, seed=7, max_tokens=10,
                                                      ignore_eos=True, logprobs=1)),
                         ("penalized", SamplingParams(temperature=0.8, seed=3, max_tokens=10, presence_penalty=0.8,
                                                      frequency_penalty=0.4, repetition_penalty=1.3, ignore_eos=True,
                                                      logprobs=1))):
        res = llm.generate(ps, params, use_tqdm=False)
        out[name] = [[c.token_ids for c in r.outputs] for r in res]
        out[name + "_logprobs"] = [[[lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)]
                                    for c in r.outputs] for r in res]
    again = llm.generate(ps[:2], greedy, use_tqdm=False)  # the shared prefix is cached now
    out["cached_tokens"] = [r.num_cached_tokens for r in again]
    out["greedy_again"] = [r.outputs[0].token_ids for r in again]
    beams = llm.beam_search(ps[:2], BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True), use_tqdm=False)
    out["beams"] = [[s.tokens for s in b.sequences] for b in beams]
    out["beam_logprobs"] = [[s.cum_logprob for s in b.sequences] for b in beams]
    if llm.engine.spec is None:  # (prompt_logprobs are refused with speculative decoding)
        scored = llm.generate(ps[3:], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2),
                              use_tqdm=False)
        out["prompt_logprobs"] = [[d[t].logprob for d, t in zip(r.prompt_logprobs[1:], r.prompt_token_ids[1:],
                                                                   strict=True)] for r in scored]
    return out


def inspect(llm: LLM) -> dict:
    from tests.hlo_checks import layer_loop_collectives, pool_copies

    runner = llm.engine.runner
    local_pool = runner.kv_pool.k.addressable_shards[0].data.shape
    steps = {}
    for key, executable in runner._executables.items():
        hlo = executable.as_text()
        per_layer, elsewhere = layer_loop_collectives(hlo, local_pool)
        aliased = "input_output_alias={" in hlo.splitlines()[0] and "may-alias" in hlo.splitlines()[0]
        steps[str(key)] = {"per_layer": per_layer, "elsewhere": elsewhere, "aliased": aliased,
                           "pool_copies": pool_copies(hlo, local_pool)}
    shardings = {}
    from jax.tree_util import keystr, tree_flatten_with_path

    for path, x in tree_flatten_with_path(runner.params)[0]:
        shard_bytes = [s.data.nbytes for s in x.addressable_shards]
        split_axis = next((i for i, axis in enumerate(x.sharding.spec) if axis == "tp"), None)
        shardings[keystr(path)] = {"shape": list(x.shape), "spec": str(x.sharding.spec), "split_axis": split_axis,
                                   "max_shard_bytes": max(shard_bytes), "bytes": int(x.nbytes)}
    return {"steps": steps, "params": shardings, "pool_shape": list(runner.kv_pool.shape),
            "pool_spec": str(runner.kv_pool.k.sharding.spec), "local_pool": list(local_pool),
            "pool_dtype": np.dtype(runner.kv_pool.dtype).name,
            "pool_devices": len(runner.kv_pool.k.sharding.device_set)}


def main(case: str, sizes: str) -> None:
    global ENGINE
    if case.endswith("_fp8"):
        case, ENGINE = case.removesuffix("_fp8"), {**ENGINE, "kv_cache_dtype": "fp8"}
    split = case.endswith("_split")
    if split:  # every runner splits its sampler from the step, as on a GPU (jaxpaged.worker.step)
        from jaxpaged.worker import model_runner

        case, fused_split = case.removesuffix("_split"), model_runner.split_sampler_here
        model_runner.split_sampler_here = lambda multihost: True
    if case.endswith("_int8") or case == "gguf":  # quantized weights, multiplied by XLA's dot at every tp
        from jaxpaged.engine import quant_setup

        quant_setup.native_quantized = lambda: False
        ENGINE = {**ENGINE, "quantization": "gguf" if case == "gguf" else "int8"}
        case = case.removesuffix("_int8")
    kernel_calls = []
    if case.endswith("_gpukernel"):  # the layer matmul kernel in every step, on each device's shard
        from jaxpaged.worker import model_runner
        from pallas_kernels import gpu_matmul

        case, kernel = case.removesuffix("_gpukernel"), gpu_matmul.layer_matmul_gpu

        def interpreted(x, w, *args, **kwargs):
            kernel_calls.append([list(x.shape), list(w.shape)])
            return kernel(x, w, *args, interpret=True, **kwargs)

        model_runner.gpu_layer_matmul_rows = lambda mesh: 64
        gpu_matmul.layer_matmul_gpu = interpreted
    speculating = case.endswith("_spec")
    if speculating:  # the model's first layer proposes 3 tokens a step: every decode step verifies
        case, ENGINE = case.removesuffix("_spec"), {
            **ENGINE, "speculative_config": {"draft_num_layers": 1, "num_speculative_tokens": 3}}
    results = {}
    if case == "ckpt":  # an Orbax checkpoint of tiny8, restored into the mesh's shardings
        import tempfile

        from jaxpaged.loader.checkpoint import write_checkpoint

        config, params = model("tiny8")
        directory = tempfile.mkdtemp() + "/ckpt"
        write_checkpoint(directory, config, params)
    for tp in map(int, sizes.split(",")):
        if case == "ckpt":
            from jaxpaged.loader import load_model

            loaded = load_model(directory, tensor_parallel_size=tp)
            results[tp] = {"restored_sharded": [str(getattr(x, "sharding", None)) for x in
                                                jax.tree.leaves(loaded.params)]}
            llm = LLM(directory, tensor_parallel_size=tp, num_blocks=48, **ENGINE)
            ps = [{"prompt_token_ids": p} for p in prompts(config.vocab_size)]
            res = llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
            results[tp]["greedy"] = [r.outputs[0].token_ids for r in res]
            if tp > 1:
                results[tp]["inspect"] = inspect(llm)
            continue
        if case == "default":
            llm = LLM(tensor_parallel_size=tp, kv_cache_memory="64MiB", **ENGINE)
            vocab = 49152
        else:
            config, params = model(case)
            llm = LLM.from_params(config, params, None, tensor_parallel_size=tp, num_blocks=48, **ENGINE)
            vocab = config.vocab_size
        results[tp] = generations(llm, vocab)
        if case != "default":
            # preemption: a pool of 12 blocks for 4 sequences of up to 5 blocks each
            small = LLM.from_params(config, params, None, tensor_parallel_size=tp, num_blocks=12, **ENGINE)
            ps = [{"prompt_token_ids": p} for p in prompts(vocab, seed=5)]
            res = small.generate(ps, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                                 use_tqdm=False)
            results[tp]["preempted"] = [r.outputs[0].token_ids for r in res]
            results[tp]["preemptions"] = small.engine.stats()["preemptions"]
        if speculating:
            stats = llm.engine.stats()
            results[tp]["spec"] = [stats["spec_proposed_tokens"], stats["spec_accepted_tokens"]]
            # n-gram: proposals looked up in the sequence itself (a random model's greedy text repeats itself)
            ngram = LLM.from_params(config, params, None, tensor_parallel_size=tp, num_blocks=48, **{
                **ENGINE, "speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                                 "prompt_lookup_min": 1, "prompt_lookup_max": 2}})
            res = ngram.generate([{"prompt_token_ids": p} for p in prompts(vocab)],
                                 SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
            results[tp]["ngram_greedy"] = [r.outputs[0].token_ids for r in res]
            stats = ngram.engine.stats()
            results[tp]["ngram_spec"] = [stats["spec_proposed_tokens"], stats["spec_accepted_tokens"]]
            if tp == 1:  # plain decoding's tokens, which speculation must not change
                plain = LLM.from_params(config, params, None, num_blocks=48,
                                        **{k: v for k, v in ENGINE.items() if k != "speculative_config"})
                results[tp]["plain"] = generations(plain, vocab)
                res = plain.generate([{"prompt_token_ids": p} for p in prompts(vocab)],
                                     SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
                results[tp]["plain_ngram_greedy"] = [r.outputs[0].token_ids for r in res]
        if split and tp == 1:  # the fused step's outputs, which the split must not change
            model_runner.split_sampler_here = fused_split
            fused = LLM.from_params(config, params, None, num_blocks=48, **ENGINE)
            model_runner.split_sampler_here = lambda multihost: True
            results[tp]["fused"] = generations(fused, vocab)
            results[tp]["split"] = llm.engine.runner.split_sampler and not fused.engine.runner.split_sampler
        if kernel_calls:  # the (x, w) shapes the kernel was traced with at this tp: each device's shards
            results[tp]["kernel_calls"] = sorted({json.dumps(c) for c in kernel_calls})
            kernel_calls.clear()
        if tp > 1 and not speculating:  # (a self-draft's own loop over its layers is a second loop in the HLO)
            results[tp]["inspect"] = inspect(llm)
    print(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
