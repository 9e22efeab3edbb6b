"""What a person looks at: the status table and the plot of a sweep, both read from its journal alone.

Usage:
    state = SweepState.replay(read_journal(sweep_dir / "journal.jsonl"))
    print(status_table(sweep, state))       # trial, parameters, rung, tokens, best loss, state
    plot_sweep(sweep, state, sweep_dir / "sweep.png")   # loss against tokens per trial, pruned marked, best in bold
"""

from __future__ import annotations

from pathlib import Path

from gpu_train.spec.sweep import SweepSpec
from gpu_train.sweeps.journal import SweepState, TrialState

PLOT = "sweep.png"


def _value(v: object) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def rung_label(sweep: SweepSpec, t: TrialState) -> str:
    """`2/3`: the rungs the trial has reached out of the sweep's, `-` without rungs."""
    rungs = sweep.rungs()
    if not rungs:
        return "-"
    return f"{sum(1 for r in rungs if r in t.reports)}/{len(rungs)}"


def status_table(sweep: SweepSpec, state: SweepState) -> str:
    best = state.best()
    rows = [("TRIAL", *sweep.parameters(), "RUNG", "TOKENS", "BEST LOSS", "STATE")]
    for t in sorted(state.trials.values(), key=lambda x: x.number):
        loss = t.best
        rows.append((t.id + (" *" if best is not None and t.id == best.id else ""),
                     *(_value(t.params.get(k)) for k in sweep.parameters()), rung_label(sweep, t),
                     f"{t.tokens:,}", "-" if loss is None else f"{loss:.4f}", t.state))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    total = sum(t.tokens for t in state.trials.values())
    counts = ", ".join(f"{len(state.by_state(s))} {s}" for s in ("running", "held", "paused", "completed", "pruned",
                                                                 "failed") if state.by_state(s))
    lines.append(f"{len(state.trials)}/{sweep.trial_config.num_trials} trials ({counts or 'none yet'}); "
                 f"{total:,} tokens trained")
    if best is not None:
        lines.append(f"best: {best.id} (*) val_loss {best.value:.4f}" + ("" if state.done else " so far"))
    return "\n".join(lines)


def plot_sweep(sweep: SweepSpec, state: SweepState, path: Path) -> Path:
    """Validation loss against tokens for every trial; pruned trials end in a cross, the best is drawn bold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = state.best()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    for t in sorted(state.trials.values(), key=lambda x: x.number):
        if not t.reports:
            continue
        xs = sorted(t.reports)
        ys = [t.reports[x] for x in xs]
        is_best = best is not None and t.id == best.id
        ax.plot(xs, ys, marker="o", markersize=3, linewidth=3 if is_best else 1, alpha=1 if is_best else 0.6,
                label=f"{t.id} (best)" if is_best else None, zorder=3 if is_best else 2)
        if t.state == "pruned":
            ax.plot([xs[-1]], [ys[-1]], marker="x", color="black", markersize=9, linestyle="none", zorder=4)
        if is_best:
            ax.plot([xs[-1]], [ys[-1]], marker="*", color="gold", markeredgecolor="black", markersize=16,
                    linestyle="none", zorder=5)
    for r in sweep.rungs():
        ax.axvline(r, color="grey", linestyle=":", linewidth=0.8)
    ax.plot([], [], marker="x", color="black", linestyle="none", label="pruned")
    ax.set_xlabel("tokens trained")
    ax.set_ylabel("validation loss")
    ax.set_title(f"sweep {sweep.name}: {sweep.algorithm.name}, early stopping {sweep.early.name}")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
