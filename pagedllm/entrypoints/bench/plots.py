"""PNG plots of `pagedllm bench` results (matplotlib, from the `bench` extra), one function per benchmark."""
from __future__ import annotations

from typing import Any


def require_matplotlib(path: str | None) -> None:
    """Fails before a benchmark runs when ``--plot`` was asked for and cannot be honoured."""
    if path is None:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(
            f"--plot {path} needs matplotlib, which is not installed: pip install 'pagedllm[bench]'"
        ) from None


def _figure(ncols: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(5 * ncols, 4))
    return plt, fig, axes


def _save(plt, fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"plot written to {path}")


def plot_serve(path: str, starts: list[float], ttfts: list[float], itls: list[float], e2es: list[float]) -> None:
    """Per request (seconds): start, TTFT and end-to-end latency; ``itls`` every inter-token gap."""
    plt, fig, axes = _figure(3)
    t0 = min(starts, default=0.0)
    axes[0].scatter([s - t0 for s in starts], [t * 1e3 for t in ttfts], s=8)
    axes[0].set(xlabel="request start (s)", ylabel="TTFT (ms)", title="Time to first token")
    axes[1].hist([g * 1e3 for g in itls] or [0.0], bins=50)
    axes[1].set(xlabel="ms", ylabel="count", title="Inter-token latency")
    axes[2].scatter([s - t0 for s in starts], e2es, s=8)
    axes[2].set(xlabel="request start (s)", ylabel="E2E (s)", title="End-to-end latency")
    _save(plt, fig, path)


def plot_latency(path: str, results: list[dict[str, Any]]) -> None:
    """`bench latency` rows: TTFT, time per output token and output rate against the batch size."""
    plt, fig, axes = _figure(3)
    sizes = [r["batch_size"] for r in results]
    for ax, key, label in (
        (axes[0], "ttft_ms", "TTFT (ms)"),
        (axes[1], "tpot_ms", "time per output token (ms)"),
        (axes[2], "output_tokens_per_s", "output tokens/s"),
    ):
        ax.plot(sizes, [r[key] for r in results], marker="o")
        ax.set_xscale("log", base=2)
        ax.set(xlabel="batch size", ylabel=label, title=label)
    _save(plt, fig, path)


def plot_throughput(path: str, start: float, arrivals: list[float], finishes: list[float]) -> None:
    """`bench throughput` requests (monotonic seconds): completions over the run and their latencies."""
    plt, fig, axes = _figure(2)
    done = sorted(f - start for f in finishes)
    axes[0].step(done, range(1, len(done) + 1), where="post")
    axes[0].set(xlabel="time since start (s)", ylabel="requests completed", title="Completions over the run")
    axes[1].hist([f - a for a, f in zip(arrivals, finishes)] or [0.0], bins=30)
    axes[1].set(xlabel="request latency (s)", ylabel="count", title="Request latency")
    _save(plt, fig, path)
