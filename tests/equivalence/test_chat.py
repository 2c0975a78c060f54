"""Chat data (jaxpar.data.chat, data.source=chat): conversations rendered with the chat
template as transformers renders them (golden ids: tests/golden/make.py --chat), the loss on
the assistant's tokens only, packing, held-out rows, and bad input refused in one line.
Training on them under a sharded layout equals one device (fp32, 1e-5, as every layout test).

Here the sharded training run; the rest, which compiles no training step, is tests/unit/test_chat.py."""

import json
import pathlib

import numpy as np

from jaxpar.config import apply_overrides

GOLDEN = pathlib.Path(__file__).parents[1] / "golden" / "chat"


from ..unit.test_chat import chat_config


def test_sft_on_conversations_equals_one_device_and_trains_only_on_the_assistant(tmp_path, reference):
    """fsdp 2 x tensor 4 on packed conversations against one device (losses and first-step
    gradients 1e-5). Changing what a user token is to predict leaves the loss as it was;
    changing an assistant token's target moves it. Held-out rows are the last conversations."""
    import jax

    from jaxpar.data.heldout import held_out_batches
    from jaxpar.data.sources import make_source
    from jaxpar.testing import check, compare, initial_state, run_layout
    from jaxpar.train import build

    conversations = json.loads((GOLDEN / "chatml" / "expected.json").read_text())
    records = [{"messages": c["messages"]} for c in conversations] * 3 + [
        {"prompt": "Plain prompt: ", "completion": "a plain completion."}]
    config = chat_config(tmp_path, records, eval_fraction=0.2)
    check(compare(run_layout(apply_overrides(config, ["mesh.fsdp=2", "mesh.tensor=4"])), reference(config)))

    trainer = build(apply_overrides(config, ["mesh.data=8"]))
    batch = make_source(trainer.batch, config)(0)
    params = initial_state(trainer).params
    loss = lambda b: trainer.evaluate(params, b)[0]
    targets, segments = np.asarray(batch["targets"]), np.asarray(batch["segment_ids"])
    # Row 0's first conversation opens with the template's system turn and ends with an
    # assistant turn's "<|im_end|>\n": its 4th target is the system prompt's, its last the assistant's.
    user, assistant = (0, 3), (0, int(np.flatnonzero(segments[0] == 0)[-1]) - 1)
    before = float(loss(batch))

    def changed(at):
        t = targets.copy()
        t[at] = (t[at] + 1) % 128
        return {**batch, "targets": jax.device_put(t, batch["targets"].sharding)}

    assert float(loss(changed(user))) == before and float(loss(changed(assistant))) != before
    held = held_out_batches(trainer.batch, config)(0)
    assert float(np.asarray(held["weights"]).sum()) > 0
