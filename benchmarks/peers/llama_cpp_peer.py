"""llama.cpp as the peer of issues #30 and #31, measured beside jaxpaged in the same run on the same GGUF file (the
default model, SmolLM2-135M-Instruct Q4_1), the same token ids and the same thread count:

  decode      batch-1 greedy decode tok/s after the first token: --decode-tokens new tokens after the 32-token
              prompt of `benchmarks/quantization.py --parts engine` (its workload_prompts(seed=1) prompt), --rounds
              rounds, median. jaxpaged: quantization.engine_part's bf16 and gguf rows (the same code path and
              timing: (tokens - 1) / (finished - first token)). llama.cpp: one llama_decode per token, greedy argmax
              of the last row's logits, no sampler or detokenizer in the loop (llama-bench's tg, plus the argmax),
              run before and after jaxpaged's rounds.
  perplexity  of the first --tokens tokens of pydoc_data.topics as `benchmarks/quality.py` scores them: windows of
              --window tokens, each a fresh sequence with BOS first and 2047 text tokens, every text token scored
              once (the same ids: jaxpaged's tokenizer cuts the text and both engines read its ids). jaxpaged:
              jaxpaged.worker.scoring.score_text, bf16 weights and the GGUF kept quantized; llama.cpp: all logits
              of each window (logits_all) through a log-softmax in float64. This is quality.py's protocol, not
              llama-perplexity's (which scores only the second half of each window of its context size).
              llama.cpp's scores are kept in --ppl-cache, so `--ppl-formats` (none) scores llama.cpp alone and a
              later run scores jaxpaged's formats beside the same figures (each takes most of a lock's 8 minutes).
  lookup      prompt-lookup decoding at batch 1 on `benchmarks/speculative.py`'s grounded and free workloads (chat
              prompts, greedy, --new-tokens, stop at EOS), tokens/s with and without, interleaved repeats, median of
              the pairs' ratios. jaxpaged: speculative.compare with "ngram k=4" (n in 2..4); llama.cpp:
              llama-cpp-python's LlamaPromptLookupDecoding(max_ngram_size=4, num_pred_tokens=4), its n-gram
              lookup over the prompt and output (n from 4 down to 1) verified in one llama_decode.

The llama.cpp side is llama-cpp-python's bundled llama.cpp, built from its PyPI sdist into a venv of its own (nothing
of it enters jaxpaged's venv or its tests); this script runs itself in that venv as a subprocess (`--worker`):

    python3 -m venv /work/llcpp-venv && /work/llcpp-venv/bin/pip install numpy
    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF" /work/llcpp-venv/bin/pip install llama_cpp_python-0.3.36.tar.gz

    python benchmarks/peers/llama_cpp_peer.py --venv /work/llcpp-venv                     # all three parts
    python benchmarks/peers/llama_cpp_peer.py --venv /work/llcpp-venv --parts perplexity --ppl-formats gguf

Each part's rows replace that part's in --out (benchmarks/results/llama_cpp_peer.json), so parts may run in separate
processes; every part records lscpu's CPU, the date and the load average.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = os.path.dirname(HERE)
DEFAULT_OUT = os.path.join(BENCHMARKS, "results", "llama_cpp_peer.json")


def default_venv() -> str:
    return os.environ.get("JAXPAGED_LLAMA_CPP_VENV") or os.path.join(
        os.path.expanduser("~"), ".cache", "jaxpaged", "peers", "llama-cpp")


# ----------------------------------------------------------------------------------------------------------------
# The worker: runs in the llama.cpp venv (numpy and llama_cpp only; no jaxpaged, no JAX).


def _llama(model: str, threads: int, n_ctx: int, logits_all: bool = False, draft=None):
    from llama_cpp import Llama

    return Llama(model_path=model, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                 n_threads_batch=threads, logits_all=logits_all, draft_model=draft, verbose=False, seed=0)


def worker_decode(req: dict) -> dict:
    import ctypes

    import llama_cpp
    import numpy as np

    llm = _llama(req["model"], req["threads"], n_ctx=512)
    ctx = llm.ctx
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(llm.model))
    prompt, new_tokens = req["prompt"], req["new_tokens"]

    def step(ids: list[int]) -> int:
        arr = (llama_cpp.llama_token * len(ids))(*ids)
        if llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, len(ids))) != 0:
            raise RuntimeError("llama_decode failed")
        logits = np.ctypeslib.as_array(ctypes.cast(llama_cpp.llama_get_logits_ith(ctx, -1),
                                                   ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,))
        return int(logits.argmax())

    rounds = []
    for r in range(req["rounds"] + 1):  # round 0 warms up
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        t0 = time.perf_counter()
        tok = step(prompt)
        t_first = time.perf_counter()
        out = [tok]
        for _ in range(new_tokens - 1):
            tok = step([tok])
            out.append(tok)
        t_end = time.perf_counter()
        if r:
            rounds.append({"tok_s": new_tokens / (t_end - t0), "decode_tok_s": (new_tokens - 1) / (t_end - t_first),
                           "first_token_ms": 1e3 * (t_first - t0)})
    return {"rounds": rounds, "token_ids": out}


def worker_perplexity(req: dict) -> dict:
    import numpy as np

    window, bos = req["window"], req["bos_token_id"]
    llm = _llama(req["model"], req["threads"], n_ctx=window, logits_all=True)
    ids = req["tokens"]
    lead = [] if bos is None else [bos]
    per = window - len(lead)
    logprobs, top = [], []
    t0 = time.perf_counter()
    for w0 in range(0, len(ids), per):
        seq = lead + ids[w0:w0 + per]
        llm.reset()
        llm.eval(seq)
        logits = llm.scores[:len(seq) - 1]  # [n - 1, V] f32: row i predicts seq[i + 1]
        tgt = np.asarray(seq[1:])
        m = logits.max(axis=1).astype(np.float64)
        lse = m + np.log(np.exp(logits - m[:, None].astype(np.float32)).sum(axis=1, dtype=np.float64))
        logprobs.append(logits[np.arange(len(tgt)), tgt] - lse)
        top.append(logits.argmax(axis=1))
    lp = np.concatenate(logprobs)
    return {"perplexity": float(np.exp(-lp.mean())), "scored_tokens": int(len(lp)),
            "score_s": time.perf_counter() - t0, "greedy": np.concatenate(top).tolist(), "logprobs": lp.tolist()}


def worker_lookup(req: dict) -> dict:
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    plain = _llama(req["model"], req["threads"], n_ctx=1024)
    spec = _llama(req["model"], req["threads"], n_ctx=1024,
                  draft=LlamaPromptLookupDecoding(max_ngram_size=req["max_ngram"], num_pred_tokens=req["k"]))

    def run(llm, prompt):
        t0 = time.perf_counter()
        out = []
        for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            if llm.token_eos() == tok or tok in req["eos"]:
                break
            out.append(tok)
            if len(out) == req["new_tokens"]:
                break
        seconds = time.perf_counter() - t0
        return {"tok_s": len(out) / seconds, "seconds": seconds, "tokens": len(out), "token_ids": out}

    rows = []
    for name, prompt in req["prompts"].items():
        for llm in (plain, spec, plain, spec):  # warm: the second run of each finds the prompt cached, as timed ones
            run(llm, prompt)
        pairs = []
        for r in range(req["repeats"]):
            if r % 2 == 0:
                p, s = run(plain, prompt), run(spec, prompt)
            else:
                s = run(spec, prompt)
                p = run(plain, prompt)
            pairs.append((p, s))
        ratios = [s["tok_s"] / p["tok_s"] for p, s in pairs]
        rows.append({"workload": name, "tok_s": statistics.median(s["tok_s"] for _, s in pairs),
                     "plain_tok_s": statistics.median(p["tok_s"] for p, _ in pairs),
                     "speedup": statistics.median(ratios), "speedup_min": min(ratios), "speedup_max": max(ratios),
                     "ratios": ratios, "tokens": pairs[0][1]["tokens"],
                     "same_tokens": all(s["token_ids"] == p["token_ids"] for p, s in pairs),
                     "token_ids": pairs[0][0]["token_ids"]})
    return {"rows": rows}


def worker_main(request_path: str, result_path: str) -> None:
    import llama_cpp

    with open(request_path) as f:
        req = json.load(f)
    result = {"decode": worker_decode, "perplexity": worker_perplexity, "lookup": worker_lookup}[req["part"]](req)
    result["llama_cpp_python"] = llama_cpp.__version__
    result["system_info"] = llama_cpp.llama_print_system_info().decode()
    with open(result_path, "w") as f:
        json.dump(result, f)


# ----------------------------------------------------------------------------------------------------------------
# The driver: runs in jaxpaged's venv.


def run_worker(args, request: dict) -> dict:
    python = os.path.join(args.venv, "bin", "python")
    if not os.path.exists(python):
        raise SystemExit(f"llama.cpp: no venv at {args.venv} (build it as this script's docstring says, or pass "
                         "--venv)")
    with tempfile.TemporaryDirectory() as tmp:
        req, res = os.path.join(tmp, "request.json"), os.path.join(tmp, "result.json")
        with open(req, "w") as f:
            json.dump({**request, "model": args.model, "threads": args.threads}, f)
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        subprocess.run([python, os.path.abspath(__file__), "--worker", req, res], check=True, env=env)
        with open(res) as f:
            return json.load(f)


def decode_part(args) -> dict:
    import quantization
    from workload import workload_prompts

    from jaxpaged.loader.tokenizer import gguf_tokenizer

    prompt = workload_prompts(gguf_tokenizer(args.model), 1, seed=1, min_len=32, max_len=32)[0]
    req = {"part": "decode", "prompt": prompt, "new_tokens": args.decode_tokens, "rounds": args.rounds}
    before = run_worker(args, req)
    qargs = argparse.Namespace(model=args.model, formats=["bf16", "gguf"], decode_tokens=args.decode_tokens,
                               rounds=args.rounds, throughput_prompts=0, max_num_seqs=64, max_model_len=1024,
                               kv_cache_memory="1GiB")
    jax_rows, _ = quantization.engine_part(qargs)
    after = run_worker(args, req)
    rounds = before["rounds"] + after["rounds"]
    rows = [{"engine": "jaxpaged", "format": r["format"], "weights": r["weight_format"],
             "decode_tok_s": r["decode_tok_s"], "tok_s": r["tok_s"],
             "decode_tok_s_min": min(r["rounds"]["decode_tok_s"]), "decode_tok_s_max": max(r["rounds"]["decode_tok_s"])}
            for r in jax_rows]
    llama = {"engine": "llama.cpp", "format": "gguf", "weights": "the file's",
             "decode_tok_s": statistics.median(x["decode_tok_s"] for x in rounds),
             "tok_s": statistics.median(x["tok_s"] for x in rounds),
             "decode_tok_s_min": min(x["decode_tok_s"] for x in rounds),
             "decode_tok_s_max": max(x["decode_tok_s"] for x in rounds),
             "decode_tok_s_before": statistics.median(x["decode_tok_s"] for x in before["rounds"]),
             "decode_tok_s_after": statistics.median(x["decode_tok_s"] for x in after["rounds"])}
    rows.append(llama)
    for r in rows:
        r["vs_llama_cpp"] = r["decode_tok_s"] / llama["decode_tok_s"]
    print(f"\nBatch-1 decode, {args.decode_tokens} greedy tokens after quantization.py's 32-token prompt, "
          f"{args.rounds} rounds per engine (llama.cpp: {args.rounds} before and {args.rounds} after jaxpaged's), "
          f"{args.threads} threads; decode tok/s after the first token, median")
    print_table(rows, [("engine", "engine", ""), ("format", "format", ""), ("decode_tok_s", "decode tok/s", ".1f"),
                       ("decode_tok_s_min", "min", ".1f"), ("decode_tok_s_max", "max", ".1f"),
                       ("tok_s", "tok/s incl. prefill", ".1f"), ("vs_llama_cpp", "x llama.cpp", ".2f")])
    return {"rows": rows, "llama_cpp_rounds": rounds, "prompt_tokens": len(prompt),
            "llama_cpp_tokens": before["token_ids"], "system_info": before["system_info"],
            "llama_cpp_python": before["llama_cpp_python"]}


def perplexity_part(args) -> dict:
    import gc

    import numpy as np
    import quality

    from jaxpaged.worker.scoring import score_text

    rows, tokens, bos, jax_greedy = [], None, None, {}
    for fmt in args.ppl_formats:
        qargs = argparse.Namespace(dtype="bfloat16", window=args.window)
        llm = quality.build(args.model, "bfloat16", "none" if fmt == "bf16" else fmt, qargs)
        if tokens is None:
            tokens = quality.text_tokens(llm.tokenizer, args.tokens)
            bos = llm.engine.model_config.bos_token_id
        t0 = time.perf_counter()
        scored = score_text(llm.engine.runner, tokens, window=args.window, chunk=args.chunk, bos_token_id=bos)
        rows.append({"engine": "jaxpaged", "format": fmt, "perplexity": scored.perplexity,
                     "scored_tokens": int(len(scored.logprobs)), "score_s": time.perf_counter() - t0})
        jax_greedy[fmt] = (np.asarray(scored.greedy), np.asarray(scored.logprobs))
        print(f"jaxpaged {fmt}: perplexity {scored.perplexity:.4f}, {rows[-1]['score_s']:.0f} s", flush=True)
        del llm, scored
        gc.collect()
    if tokens is None:  # llama.cpp alone (it takes one lock's time by itself): the ids jaxpaged's engine scores
        import gguf

        from jaxpaged.loader.gguf_file import model_config_from_gguf
        from jaxpaged.loader.tokenizer import gguf_tokenizer

        tokens = quality.text_tokens(gguf_tokenizer(args.model), args.tokens)
        bos = model_config_from_gguf(gguf.GGUFReader(args.model)).bos_token_id
    # llama.cpp's scores depend only on the file, the ids, the window and the build: they are kept in --ppl-cache
    # (keyed by those), so jaxpaged's formats can be scored in a later lock's time beside the same llama.cpp figures
    key = hashlib.sha256(json.dumps([os.path.abspath(args.model), os.path.getsize(args.model), tokens, args.window,
                                     bos]).encode()).hexdigest()[:16]
    cache = os.path.join(args.ppl_cache, f"llama_cpp_ppl_{key}.json")
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if os.path.exists(cache):
        with open(cache) as f:
            res = json.load(f)
        print(f"llama.cpp: scores of {res['date']} from {cache}")
    else:
        res = run_worker(args, {"part": "perplexity", "tokens": tokens, "window": args.window, "bos_token_id": bos})
        res["date"] = date
        os.makedirs(args.ppl_cache, exist_ok=True)
        with open(cache, "w") as f:
            json.dump(res, f)
    llama = {"engine": "llama.cpp", "format": "gguf", "perplexity": res["perplexity"],
             "scored_tokens": res["scored_tokens"], "score_s": res["score_s"], "date": res["date"]}
    for r in rows:
        r["date"] = date
    rows.append(llama)
    lgreedy, llp = np.asarray(res["greedy"]), np.asarray(res["logprobs"])
    for r in rows:
        r["vs_llama_cpp"] = r["perplexity"] / llama["perplexity"] - 1.0
        if r["engine"] == "jaxpaged":
            g, lp = jax_greedy[r["format"]]
            r["top1_agreement_llama_cpp"] = float(np.mean(g == lgreedy))
            r["mean_abs_logprob_diff_llama_cpp"] = float(np.mean(np.abs(lp - llp)))
    print(f"\nPerplexity of the first {args.tokens} tokens of pydoc_data.topics, windows of {args.window} (BOS + "
          f"{args.window - 1} text tokens), every text token scored once, the same token ids in both engines")
    print_table(rows, [("engine", "engine", ""), ("format", "format", ""), ("perplexity", "perplexity", ".4f"),
                       ("vs_llama_cpp", "vs llama.cpp", "+.2%"),
                       ("top1_agreement_llama_cpp", "top-1 = llama.cpp", ".2%"),
                       ("mean_abs_logprob_diff_llama_cpp", "mean |d logprob|", ".4f"), ("score_s", "seconds", ".0f")])
    # jaxpaged rows of formats this run did not score stay from the earlier run in --out, each with its date
    ran = {(r["engine"], r["format"]) for r in rows}
    rows += [r for r in args.earlier.get("perplexity", {}).get("rows", []) if (r["engine"], r["format"]) not in ran]
    for r in rows:
        r["vs_llama_cpp"] = r["perplexity"] / llama["perplexity"] - 1.0
    rows.sort(key=lambda r: (r["engine"] != "jaxpaged", r["format"] != "bf16"))
    print_table(rows, [("engine", "engine", ""), ("format", "format", ""), ("perplexity", "perplexity", ".4f"),
                       ("vs_llama_cpp", "vs llama.cpp", "+.2%"), ("date", "run", "")])
    return {"rows": rows, "tokens": args.tokens, "window": args.window, "chunk": args.chunk, "bos_token_id": bos,
            "system_info": res["system_info"], "llama_cpp_python": res["llama_cpp_python"]}


def lookup_part(args) -> dict:
    import speculative

    jax_rows = []
    plain_llm = speculative.make_llm("plain", 1, None)
    prompts = {w: speculative.prompts_for(plain_llm, w, 1)[0]["prompt_token_ids"] for w in args.workloads}
    eos = sorted(plain_llm.engine.eos_token_ids)
    sargs = argparse.Namespace(new_tokens=args.new_tokens, repeats=args.repeats)
    spec_llm = speculative.make_llm("ngram k=4", 1, None)
    plain_tokens = {}
    for w in args.workloads:
        row = speculative.compare("ngram k=4", spec_llm, plain_llm, w, 1, sargs)
        plain_tokens[w] = speculative.timed_run(plain_llm, w, 1, args.new_tokens)["token_ids"][0]
        jax_rows.append({"engine": "jaxpaged", "workload": w, "method": "ngram k=4 (n 2..4)", **{
            k: row[k] for k in ("tok_s", "plain_tok_s", "speedup", "speedup_min", "speedup_max", "ratios", "tokens",
                                "acceptance", "mean_accepted_length", "same_tokens")}})
        print(f"jaxpaged {w}: {row['tok_s']:.1f} tok/s, plain {row['plain_tok_s']:.1f}, x{row['speedup']:.2f}",
              flush=True)
    del spec_llm, plain_llm
    res = run_worker(args, {"part": "lookup", "prompts": prompts, "new_tokens": args.new_tokens,
                            "repeats": args.repeats, "k": 4, "max_ngram": 4, "eos": eos})
    rows = []
    for w in args.workloads:
        rows.append(next(r for r in jax_rows if r["workload"] == w))
        lr = next(r for r in res["rows"] if r["workload"] == w)
        rows.append({"engine": "llama.cpp", "method": "prompt lookup k=4 (n 4..1)",
                     **{k: v for k, v in lr.items() if k != "token_ids"},
                     "same_tokens_as_jaxpaged_bf16": lr["token_ids"] == list(plain_tokens[w])})
    print(f"\nPrompt-lookup decoding at batch 1, speculative.py's workloads (one chat prompt each), greedy, at most "
          f"{args.new_tokens} new tokens; {args.repeats} interleaved plain/lookup pairs per engine, median ratio")
    print_table(rows, [("engine", "engine", ""), ("workload", "workload", ""), ("method", "method", ""),
                       ("tok_s", "tok/s", ".1f"), ("plain_tok_s", "plain tok/s", ".1f"),
                       ("speedup", "vs plain", ".2f"), ("speedup_min", "min", ".2f"), ("speedup_max", "max", ".2f"),
                       ("tokens", "tokens", "d"), ("same_tokens", "same tokens as plain", "")])
    return {"rows": rows, "system_info": res["system_info"], "llama_cpp_python": res["llama_cpp_python"],
            "prompt_tokens": {w: len(p) for w, p in prompts.items()}}


def print_table(rows, columns):
    from common import print_table as table

    table(rows, columns)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=2, metavar=("REQUEST", "RESULT"), help=argparse.SUPPRESS)
    ap.add_argument("--parts", nargs="+", default=["decode", "perplexity", "lookup"],
                    choices=["decode", "perplexity", "lookup"])
    ap.add_argument("--venv", default=default_venv(), help="the llama.cpp venv (default: $JAXPAGED_LLAMA_CPP_VENV "
                    "or ~/.cache/jaxpaged/peers/llama-cpp)")
    ap.add_argument("--model", default=None, help="a GGUF file (default: the default model's)")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (this machine's cores)")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--ppl-formats", nargs="*", default=["bf16", "gguf"], choices=["bf16", "gguf"],
                    help="jaxpaged's formats in the perplexity part (none: llama.cpp's row alone)")
    ap.add_argument("--ppl-cache", default=os.path.join(tempfile.gettempdir(), "jaxpaged-llama-cpp"),
                    help="where llama.cpp's perplexity scores are kept between runs")
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--workloads", nargs="+", default=["grounded", "free"], choices=["grounded", "free"])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args()
    if args.worker:
        worker_main(*args.worker)
        return
    sys.path[:0] = [BENCHMARKS, os.path.dirname(BENCHMARKS)]
    from common import cpu_name, write_json

    from jaxpaged.loader import default_model_path

    args.model = args.model or default_model_path()
    result = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            result = json.load(f)
    args.earlier = dict(result)
    result.update({"cpu": cpu_name(), "model": args.model})
    print(f"CPU: {result['cpu']}; model {args.model}; llama.cpp venv {args.venv}", flush=True)
    for part in args.parts:
        load = os.getloadavg()
        t0 = time.perf_counter()
        out = {"decode": decode_part, "perplexity": perplexity_part, "lookup": lookup_part}[part](args)
        result[part] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "threads": args.threads,
                        "load_average_before": load, "load_average_after": os.getloadavg(),
                        "wall_s": time.perf_counter() - t0, **out}
    write_json(args.out, result)


if __name__ == "__main__":
    main()
