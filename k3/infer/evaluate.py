"""``k3 eval --run DIR``: validation loss and perplexity of a run's checkpoint (and recall accuracy for the recall
task), on exactly the held-out data the run was trained against."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TextIO

from k3.ckpt.run import load_checkpoint
from k3.train.trainer import TrainArgs, build_data, cpu_threads, evaluate_model, resolve_device

__all__ = ["evaluate_run"]


def evaluate_run(run: str | Path, device: str = "auto", batches: int | None = None,
                 batch_size: int | None = None, stream: TextIO | None = None,
                 as_json: bool = False, force_memory: bool = False) -> dict[str, Any]:
    """Load the newest checkpoint of ``run`` (or the checkpoint directory itself) and evaluate it.

    ``batches``/``batch_size`` default to the run's ``eval_batches``/``batch_size``. Returns the metrics dict
    (``step``, ``val_loss``, ``val_ppl``, ``val_tokens`` and, for the recall task, ``val_accuracy``).
    """
    if batches is not None and (isinstance(batches, bool) or not isinstance(batches, int) or batches <= 0):
        raise ValueError(f"--batches must be a positive integer, got {batches!r}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0):
        raise ValueError(f"--batch-size must be a positive integer, got {batch_size!r}")
    dev = resolve_device(device)
    ck = load_checkpoint(run, device=dev, force_memory=force_memory)
    args = TrainArgs.from_dict({**ck["run_args"], "threads": 0})  # the run's thread count is not eval's
    if batches is not None:
        args.eval_batches = batches
    if batch_size is not None:
        args.batch_size = batch_size
    args.validate()
    data = build_data(args, ck["tokenizer"], ck["config"])
    with cpu_threads(dev, ck["config"].hidden_size):
        result = evaluate_model(ck["model"], data, args, dev)
    metrics = {"step": ck["step"], "checkpoint": str(ck["dir"]), "task": args.task, **result}
    if stream is not None:
        if as_json:
            stream.write(json.dumps(metrics) + "\n")
        else:
            acc = f"  recall accuracy {metrics['val_accuracy']:.2%}" if "val_accuracy" in metrics else ""
            stream.write(f"{ck['dir']} (step {ck['step']}): val loss {metrics['val_loss']:.4f}  perplexity "
                         f"{metrics['val_ppl']:.3f}  ({metrics['val_tokens']} tokens){acc}\n")
        stream.flush()
    return metrics
