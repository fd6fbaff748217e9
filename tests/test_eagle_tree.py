"""EAGLE-2 dynamic trees with the EAGLE drafter: greedy tree decoding is token-identical to AR (tiny random model).

Needs the tree decoder (``toolkit.speculative.tree`` / ``tree_dynamic``, the tree issue); skipped where it is absent.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("toolkit.speculative.tree_dynamic")

from test_decoder import hf_greedy, make_prompt  # noqa: E402
from test_eagle import INIT, NEW_TOKENS, target, trained_head  # noqa: E402,F401  (fixtures)

from toolkit.recipe import GenerationSpec  # noqa: E402
from toolkit.engine.planner import ConstantK  # noqa: E402
from toolkit.engine.decoder import SpeculativeDecoder  # noqa: E402
from toolkit.speculative.drafters.eagle import EagleDrafter  # noqa: E402
from toolkit.speculative.stats import GenerationStats  # noqa: E402
from toolkit.speculative.tree import TreeShape  # noqa: E402


@pytest.mark.parametrize("shape", [TreeShape(budget=8, depth=4, topk=2), TreeShape(budget=16, depth=5, topk=4)])
def test_greedy_eagle_tree_matches_ar(target, trained_head, shape):  # noqa: F811
    prompt = make_prompt(0)
    reference = hf_greedy(target, prompt, NEW_TOKENS)
    stats = GenerationStats()
    decoder = SpeculativeDecoder(target, EagleDrafter(target, trained_head), ConstantK(3), tree=shape)
    ids = [t for chunk in decoder.decode(prompt, GenerationSpec(max_new_tokens=NEW_TOKENS, ignore_eos=True), stats)
           for t in chunk]
    assert ids == reference
    assert stats.accepted > 0 and stats.rounds >= 2
    assert stats.drafted > stats.accepted
    from test_eagle import _foreign_hooks

    assert not _foreign_hooks(target)  # features come with the forward's outputs, not from hooks


def test_tree_and_linear_agree_on_the_first_path(target, trained_head):  # noqa: F811
    """A topk-1 tree is the linear greedy draft: same tokens as a chain proposal from the same state."""
    from toolkit.engine.forward import select_hidden
    from toolkit.engine.rows import Row
    from toolkit.recipe import GenerationSpec
    from toolkit.speculative.stats import GenerationStats

    prompt = make_prompt(2)
    ids = prompt[0].tolist() + [5]
    drafters = {tree: EagleDrafter(target, trained_head) for tree in (False, True)}
    with torch.inference_mode():  # the prompt's features, as the decoder's prefill returns them
        features = select_hidden(target(prompt, output_hidden_states=True), drafters[False].features)
    rows = {}
    for tree, drafter in drafters.items():
        drafter.start(1, 256, 8, GenerationSpec(), tree=TreeShape(4, 4, 1) if tree else None)
        rows[tree] = Row(0, len(ids) - 1, list(ids), GenerationStats(), None, 0.0, [5])
        drafter.join(rows[tree], features)
    drafters[False].propose_rows([rows[False]], [4])
    tree = drafters[True].propose_tree_row(rows[True], 4, 4, 1)
    assert tree.token_list() == rows[False].proposal
    assert tree.parent_list() == [-1, 0, 1, 2]
