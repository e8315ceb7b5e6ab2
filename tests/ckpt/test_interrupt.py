"""Ctrl-C during a checkpoint save: the save finishes, then the interrupt is raised (``interrupts_deferred``);
a second Ctrl-C raises at once; the handler is restored."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from k3.ckpt.run import find_checkpoint, save_checkpoint, verify_checkpoint
from k3.config import K3Config
from k3.data.tokenizers import ByteTokenizer
from k3.model import K3ForCausalLM
from k3.utils import interrupts_deferred


def _sigint() -> None:
    os.kill(os.getpid(), signal.SIGINT)


def test_one_interrupt_is_held_until_the_block_ends():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            _sigint()
            done.append("after the signal")
    assert done == ["after the signal"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with interrupts_deferred():  # no signal, no exception
        done.append("quiet")
    assert done[-1] == "quiet"


def test_a_second_interrupt_raises_at_once():
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            _sigint()
            _sigint()
            reached.append("past the second")
    assert reached == [] and signal.getsignal(signal.SIGINT) is signal.default_int_handler


class _InterruptWhilePickled:
    """Sends SIGINT to this process while ``torch.save`` is writing the checkpoint."""

    def __reduce__(self):
        _sigint()
        return (int, (7,))


def test_interrupt_inside_torch_save_leaves_a_complete_checkpoint(tmp_path):
    model = K3ForCausalLM(K3Config.from_preset("tiny"))
    state = {"step": 3, "x": torch.arange(4), "probe": _InterruptWhilePickled()}
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 3, model, model.config, ByteTokenizer(), state, {"preset": "tiny"})
    ckpt = find_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.name == "step-00000003"
    verify_checkpoint(ckpt)  # every file complete and matching its manifest
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000003"]


class _InterruptTwiceWhilePickled:
    def __reduce__(self):
        _sigint()
        _sigint()
        return (int, (7,))


def test_two_interrupts_inside_torch_save_stop_at_once_and_publish_nothing(tmp_path):
    model = K3ForCausalLM(K3Config.from_preset("tiny"))
    state = {"step": 3, "probe": _InterruptTwiceWhilePickled()}
    with pytest.raises(KeyboardInterrupt):  # not the zip writer's RuntimeError
        save_checkpoint(tmp_path, 3, model, model.config, ByteTokenizer(), state, {"preset": "tiny"})
    assert list((tmp_path / "checkpoints").iterdir()) == []  # nothing published, the staged directory gone too
