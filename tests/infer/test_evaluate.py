"""``k3 eval``: validation loss/perplexity on the run's held-out data; recall accuracy for the recall task."""

import json
import math

import k3_runs


def test_eval_text_run(tiny_run):
    code, out, err = k3_runs.run_cli("eval", "--run", str(tiny_run), "--json")
    assert code == 0, err
    m = json.loads(out)
    assert m["step"] == 4 and m["task"] == "text" and m["val_tokens"] == 2 * 16
    assert math.isclose(m["val_ppl"], math.exp(m["val_loss"]), rel_tol=1e-6)
    logged = [json.loads(l) for l in (tiny_run / "metrics.jsonl").read_text().splitlines()][-1]
    assert math.isclose(m["val_loss"], logged["val_loss"], rel_tol=1e-5)  # the same batches as at the end of training
    code, out, _ = k3_runs.run_cli("eval", "--run", str(tiny_run), "--batches", "2")
    assert code == 0 and "val loss" in out and "perplexity" in out


def test_recall_task_trains_and_reports_accuracy(runs_base):
    run = k3_runs.cached_run(runs_base, "recall", "--task", "recall", "--steps", "3", *k3_runs.FAST)
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert all("accuracy" in r for r in rows) and "val_accuracy" in rows[-1]
    code, out, err = k3_runs.run_cli("eval", "--run", str(run), "--json")
    assert code == 0, err
    m = json.loads(out)
    assert m["task"] == "recall" and 0.0 <= m["val_accuracy"] <= 1.0
    assert m["val_tokens"] == 2 * 3  # seq_len 16 → 3 pairs, 3 scored queries per sequence
