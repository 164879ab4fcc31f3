"""The README quick-start request (SmolLM2-135M, suffix, 128 tokens) four times in one session, the target's
graph cache off, on, off, on: target passes and graphs reused each time. Run from the repository root."""

from power_core import PowerConfig, Session

prompt = open("docs/examples/code-edit.txt").read()
cfg = PowerConfig(spec_mode="suffix", n_threads=2, max_tokens=128)
with Session.open(cfg) as s:
    ctx = s.opened.target.ctx
    for on in (False, True, False, True):
        ctx.set_graph_cache(on)
        r0, p0 = ctx.graphs_reused, ctx.passes
        r = s.generate(prompt, max_tokens=128)
        print("cache", on, "reused", ctx.graphs_reused - r0, "of passes", ctx.passes - p0)
