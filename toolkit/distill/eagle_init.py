"""A fresh EAGLE head to train (:mod:`toolkit.distill.eagle_train`): EAGLE-1 or EAGLE-3 layout, reduced draft
vocabulary (FR-Spec: the most frequent tokens of the training data), started as "pass the feature through"."""

from __future__ import annotations

import torch


def build_head(target, draft_vocab: int, counts: torch.Tensor, seed: int, variant: str = "eagle1"):
    """A fresh head for ``target`` in ``variant``'s layout with the ``draft_vocab`` most frequent tokens of
    ``counts``. It starts as "pass the feature through": EAGLE-1's ``fc`` copies the normed last-layer feature,
    EAGLE-3's copies its highest feature layer and its ``norm`` is the target's final norm (a logit lens of that
    layer); the LM head starts as the target's rows of the draft vocabulary, frozen for EAGLE-1, trained for
    EAGLE-3 (its own, as in the EAGLE-3 paper)."""
    from toolkit.eagle.checkpoint import dense_weight
    from toolkit.eagle.features import final_norm
    from toolkit.eagle.head import EagleHead, HeadConfig
    from toolkit.eagle.vocab import frequent_tokens
    from toolkit.quant.block_embedding import embedding_table

    torch.manual_seed(seed)
    config = HeadConfig.from_target(target.config, variant, draft_vocab)
    head = EagleHead(config)
    for module in head.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
    h = config.hidden_size
    with torch.no_grad():
        head.fc.weight[:, -h:] = torch.eye(h)  # EAGLE-1: (embed, feature) -> feature; EAGLE-3: the highest layer
        head.layer.self_attn.o_proj.weight.mul_(0.1)
        head.layer.mlp.down_proj.weight.mul_(0.1)
        norm = final_norm(target)
        if variant == "eagle3" and getattr(norm, "weight", None) is not None and norm.weight.shape == (h,):
            head.norm.weight.copy_(norm.weight.detach().float())
    eos = [target.config.eos_token_id] if isinstance(target.config.eos_token_id, int) else list(
        target.config.eos_token_id or [])
    ids = frequent_tokens(counts, draft_vocab, eos)
    head.draft_to_target = ids
    embedding = embedding_table(target.get_input_embeddings()).float().cpu()  # a GGUF block embedding: dequantized
    lm = dense_weight(target.get_output_embeddings()).float().cpu()
    head.embed_tokens.weight.data.copy_(embedding)
    head.lm_head.weight.data.copy_(lm[ids])
    head.embed_tokens.requires_grad_(False)
    head.lm_head.requires_grad_(variant == "eagle3")
    return head
