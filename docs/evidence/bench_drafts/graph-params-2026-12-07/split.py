"""Split the driver thread's samples of a ``py-spy record --native -f raw`` profile of ``inprocess.py``
(``../host-2026-12-06/``) into llama.cpp compute, the graph-cache lookup (and in it the scheduler's
reset, its graph allocation and the graph parameters' copy), the rest of llama.cpp's decode, and
Python with everything else; shares of the samples that are not compute. Idle waits between requests
(``Condition.wait``) are left out.

    python docs/evidence/bench_drafts/sparse-reset-2026-12-07/split.py PROFILE.raw [...]
"""
import collections
import sys

for path in sys.argv[1:]:
    tot: collections.Counter[str] = collections.Counter()
    for line in open(path):
        stack, _, n_text = line.rstrip().rpartition(" ")
        n = int(n_text)
        fr = [f.split(" (")[0] for f in stack.split(";")]
        if "SharedPasses._loop" not in fr or "Condition.wait" in fr:
            continue
        tot["round"] += n
        if any("ggml_graph_compute" in f or "ggml_compute_forward" in f for f in fr):
            tot["compute"] += n
        elif "llama_context::graph_cache_find" in fr:
            tot["cache_find"] += n
            for part in ("ggml_backend_sched_reset", "ggml_backend_sched_alloc_graph", "llama_context::graph_params"):
                if part in fr:
                    tot["  " + part] += n
        elif any("llama_context::decode" in f for f in fr):
            tot["llama other"] += n
        else:
            tot["python+other"] += n
    host = tot["round"] - tot["compute"]
    print(path, f"driver samples {tot['round']}, not compute {host}")
    for k, v in tot.items():
        if k not in ("round", "compute"):
            print(f"   {k:36s} {v:5d}  {100 * v / host:5.1f} %")
