"""Which module hooks need the module's own call (``opsnn_lab._hooks``): a user's always, opsnn_lab's passive ones
never, Hugging Face's output-capturing ones only in a call that collects what they record."""

from __future__ import annotations

import pytest
from torch import nn

from opsnn_lab._hooks import has_hooks, hooks_in_effect, passive


def test_a_users_hook_counts_and_a_passive_one_does_not():
    m = nn.Linear(2, 2)
    assert hooks_in_effect(m) == "" and not has_hooks(m)
    handle = m.register_forward_pre_hook(passive(lambda mod, args: None))
    assert hooks_in_effect(m) == "" and not has_hooks(m)
    m.register_forward_hook(lambda mod, args, out: None)
    assert hooks_in_effect(m) == "user" and has_hooks(m)
    handle.remove()
    assert hooks_in_effect(m) == "user"


def test_hugging_face_capturing_hooks_count_only_while_their_key_is_collected():
    capturing = pytest.importorskip("transformers.utils.output_capturing")
    m = nn.Linear(2, 2)
    capturing.install_output_capuring_hook(m, "attentions", 1)
    assert has_hooks(m)  # the analysis counts it: fx code keeps the module as a call
    assert hooks_in_effect(m) == ""  # no call collects
    for collected, want in (({"hidden_states": []}, ""), ({"attentions": []}, "capture"),
                            ({"attentions": [], "hidden_states": []}, "capture")):
        token = capturing._active_collector.set(collected)
        try:
            assert hooks_in_effect(m) == want, collected
        finally:
            capturing._active_collector.reset(token)
    assert hooks_in_effect(m) == ""
    m.register_forward_hook(lambda mod, args, out: None)  # a user's beside it
    assert hooks_in_effect(m) == "user"
