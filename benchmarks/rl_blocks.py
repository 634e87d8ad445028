"""Per-block averages of an RL run's metrics.jsonl, and its held-out evaluations.

    python benchmarks/rl_blocks.py RUN_DIR [BLOCK_SIZE]

Prints the evaluations (iteration, eval/success_once), then per block of BLOCK_SIZE (default 10) updates:
rollout success over all ended episodes and over each env's first episode (rollout/success_first, the
unbiased one), approx-KL, clip-fraction and explained variance. Records of the same iteration (a file
appended to across restarts) are merged, the later one's values winning.
"""

import json
import statistics
import sys


def mean_of(block: list[dict], key: str) -> float:
    vals = [x[key] for x in block if key in x]
    return statistics.mean(vals) if vals else float("nan")


def main() -> None:
    run, size = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10
    d: dict[int, dict] = {}
    with open(f"{run}/metrics.jsonl") as f:
        for line in f:
            x = json.loads(line)
            d.setdefault(x["iteration"], {}).update(x)
    print("evals:", [(i, d[i]["eval/success_once"]) for i in sorted(d) if "eval/success_once" in d[i]])
    h = [d[i] for i in sorted(d) if "losses/approx_kl" in d[i]]
    for a in range(0, len(h), size):
        b = h[a:a + size]
        m = {k: mean_of(b, k) for k in ("rollout/success_once", "rollout/success_first", "losses/approx_kl",
                                          "losses/clipfrac", "losses/explained_variance")}
        print(b[0]["iteration"], b[-1]["iteration"],
              f"succ {m['rollout/success_once']:.2f} succ1 {m['rollout/success_first']:.2f} "
              f"approx-KL {m['losses/approx_kl']:.4f} clip {m['losses/clipfrac']:.3f} "
              f"EV {m['losses/explained_variance']:.2f}")


if __name__ == "__main__":
    main()
