"""The sampler's random draw and log-probs on CPU, XLA against the native kernels, in one run on the same logits:
where a sampled step's sampler time goes (the profile), then what the native Gumbel-max draw
(`cpu_native.gumbel_argmax_native`), top-p threshold (`cpu_native.top_p_threshold_native`) and log-probs
(`cpu_native.logprobs_native`) leave of it.

Rows S of a decode step, logits [S, V] ~ N(0, 3^2) at SmolLM2's vocabulary (49152) and Gemma 3's (262144). Timed,
each jitted, as the median of --samples samples of --reps back-to-back calls:
  noise         jax.random.gumbel's [S, V] noise alone (the rows' keys as the sampler derives them)
  XLA draw      argmax(x + noise): `sampler._draw` as XLA runs it
  native draw   the same draw by the native kernel (the noise never written)
  sample t=1    `sampler.sample` at temperature 1 (no filter), XLA / native
  sample p=.95  `sampler.sample` at temperature 1, top-p 0.95, XLA / native
  logprobs      `sampler.sample` at temperature 0 with every row asking for log-probs (the chosen token's and the top
                20: XLA's log-sum-exp and TopK, or the native kernel's two passes), XLA / native
  log-softmax   for scale: jax.nn.log_softmax then lax.top_k, the way the sampler took them before the kernel
and the rows whose token differs between the two ways (the native noise is XLA's bit for bit: 0 expected), the top
log-prob tokens that differ (0 expected) and the largest difference between the two ways' log-probs.

    python benchmarks/sampler_draw.py       # -> benchmarks/results/sampler_draw.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os

from common import RESULTS_DIR, cpu_name, print_table, time_call, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 48, 256])
    ap.add_argument("--vocab", type=int, nargs="+", default=[49152, 262144])
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "sampler_draw.json"))
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxpaged.worker import sampler
    from pallas_kernels import cpu_native

    for kernel in ("gumbel", "top_p", "argmax", "logprobs"):
        if not cpu_native.available(kernel):
            raise SystemExit(f"the native {kernel} kernel is unavailable here: {cpu_native.unavailable_reason(kernel)}")
    rng = np.random.default_rng(0)
    rows = []
    for vocab in args.vocab:
        for s in args.rows:
            logits = jnp.asarray(rng.standard_normal((s, vocab), np.float32) * 3)
            meta = sampler.SamplingMetadata.padding(s, vocab_size=vocab)
            meta.temperature[:] = 1.0
            meta.seed_lo[:] = np.arange(s)
            keys = sampler._row_keys(jnp.asarray(meta.seed_lo), jnp.asarray(meta.seed_hi), jnp.asarray(meta.step))
            filtered = dataclasses.replace(meta, top_p=np.full(s, 0.95, np.float32))
            asking = dataclasses.replace(meta, temperature=np.zeros(s, np.float32), want_logprobs=np.array(True))
            ways = {
                "noise": (functools.partial(sampler._gumbel, vocab=vocab), (keys,)),
                "xla_draw": (functools.partial(sampler._draw, native=False), (logits, keys)),
                "native_draw": (functools.partial(sampler._draw, native=True), (logits, keys)),
                "xla_t1": (functools.partial(sampler.sample, native=False), (logits, meta)),
                "native_t1": (functools.partial(sampler.sample, native=True), (logits, meta)),
                "xla_p95": (functools.partial(sampler.sample, native=False), (logits, filtered)),
                "native_p95": (functools.partial(sampler.sample, native=True), (logits, filtered)),
                "xla_lp": (functools.partial(sampler.sample, native=False), (logits, asking)),
                "native_lp": (functools.partial(sampler.sample, native=True), (logits, asking)),
                "log_softmax": (lambda x: jax.lax.top_k(jax.nn.log_softmax(x, axis=-1), 20), (logits,)),
            }
            row = {"rows": s, "vocab": vocab}
            tokens, outs = {}, {}
            for name, (fn, fn_args) in ways.items():
                fn = jax.jit(fn)
                outs[name] = out = fn(*fn_args)
                tokens[name] = np.asarray(out.tokens if hasattr(out, "tokens") else out)
                row[f"{name}_ms"] = 1e3 * time_call(fn, fn_args, warmup=1, samples=args.samples, reps=args.reps)
            row["differ"] = int(sum(np.sum(tokens[f"xla_{w}"] != tokens[f"native_{w}"])
                                    for w in ("draw", "t1", "p95", "lp")))
            xla_lp, native_lp = outs["xla_lp"].lp, outs["native_lp"].lp
            row["top_ids_differ"] = int(np.sum(np.asarray(xla_lp.top_ids) != np.asarray(native_lp.top_ids)))
            row["logprob_max_diff"] = float(max(
                np.max(np.abs(np.asarray(getattr(xla_lp, f)) - np.asarray(getattr(native_lp, f))))
                for f in ("logprobs", "top_logprobs")))
            rows.append(row)
            print(row, flush=True)

    cpu = cpu_name()
    print(f"\nCPU: {cpu}, {os.cpu_count()} cores; logits N(0, 3^2); milliseconds per call")
    print_table(rows, [("vocab", "V", "d"), ("rows", "rows", "d"), ("noise_ms", "noise", ".2f"),
                       ("xla_draw_ms", "XLA draw", ".2f"), ("native_draw_ms", "native draw", ".2f"),
                       ("xla_t1_ms", "sample t=1 XLA", ".2f"), ("native_t1_ms", "native", ".2f"),
                       ("xla_p95_ms", "sample p=.95 XLA", ".2f"), ("native_p95_ms", "native", ".2f"),
                       ("xla_lp_ms", "logprobs XLA", ".2f"), ("native_lp_ms", "native", ".2f"),
                       ("log_softmax_ms", "log_softmax+top_k", ".2f"),
                       ("differ", "tokens that differ", "d"), ("top_ids_differ", "top ids that differ", "d"),
                       ("logprob_max_diff", "log-prob max diff", ".1e")])
    write_json(args.out, {"cpu": cpu, "command": "python benchmarks/sampler_draw.py", "rows": rows})


if __name__ == "__main__":
    main()
