"""A checkpoint as a Hugging Face model directory (the library behind ``molds-export``).

Writes safetensors weights, ``config.json`` and the manifest's tokenizer, so that
``AutoModelForCausalLM`` (decoder: ``LlamaForCausalLM``; MoE decoder:
``Qwen3MoeForCausalLM``, or with sigmoid routing and a shared expert, which Qwen3-MoE
does not have, ``Dots1ForCausalLM``: dots.llm1's Qwen3 attention with DeepSeek-V3's
MoE), ``AutoModelForMaskedLM`` (encoder) or
``AutoModelForSequenceClassification`` (encoder with property heads) and
``AutoTokenizer`` load it with no molds installed. The checkpoint is opened with the
same factory and canonical weights as training (``molds.checkpoint.open_checkpoint``),
so every engine's checkpoint exports the same way and nothing is unpickled.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

from .checkpoint import open_checkpoint
from .chemistry.representation import of_manifest
from .errors import MoldsError
from .eval.pairs import forbidden_in_targets
from .eval.sampling import forbidden_tokens
from .runtime.atomic import atomic_directory


def llama_config(cfg, specials):
    from transformers import LlamaConfig  # here: molds-export --help loads no transformers

    return LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings, hidden_act="silu", attention_bias=False, mlp_bias=False,
        head_dim=cfg.head_dim, bos_token_id=specials.bos, eos_token_id=specials.eos, pad_token_id=specials.pad)


def _strict(model, state: dict, allowed_missing=()):
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in allowed_missing]
    if missing or unexpected:
        raise ValueError(f"checkpoint and {type(model).__name__} disagree: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model


def hf_decoder(model, specials):
    """The Hugging Face twin of a molds decoder, weights copied."""
    cfg = model.config
    state = {k: v.detach().float() for k, v in model.state_dict().items()}
    if cfg.moe is not None:
        moe = cfg.moe
        if moe.score == "sigmoid" and moe.shared_expert_size:
            return hf_dots1(model, specials)
        return hf_qwen3_moe(model, specials)
    from transformers import LlamaForCausalLM  # here: molds-export --help loads no transformers

    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return _strict(LlamaForCausalLM(llama_config(cfg, specials)), state, ("lm_head.weight",))


def hf_qwen3_moe(model, specials):
    """The MoE decoder as ``Qwen3MoeForCausalLM``: the same attention (with per-head
    q/k RMSNorm), softmax top-k routing renormalized (``norm_topk_prob``), SwiGLU experts
    (HF stacks them: ``gate_up_proj`` [E, 2 x width, hidden], ``down_proj`` [E, hidden, width]),
    dense blocks as ``mlp_only_layers``."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # here: molds-export --help loads no transformers

    from .models.moe import moe_layers  # here: molds-export --help loads no Triton

    cfg, moe = model.config, model.config.moe
    if moe.score != "softmax" or moe.shared_expert_size or moe.capacity_factor:
        raise MoldsError("Qwen3-MoE routes by softmax, without a shared expert or a capacity: this model "
                         f"(moe_score={moe.score}, moe_shared_expert_size={moe.shared_expert_size}, "
                         f"moe_capacity_factor={moe.capacity_factor}) has no Hugging Face twin to export to")
    sparse = {layer.layer_id for layer in moe_layers(model)}
    hf_cfg = Qwen3MoeConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=moe.expert_size or cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, attention_bias=False,
        tie_word_embeddings=cfg.tie_word_embeddings, num_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=sorted(set(range(cfg.num_layers)) - sparse),
        router_aux_loss_coef=moe.aux_loss_coef, hidden_act="silu", bos_token_id=specials.bos,
        eos_token_id=specials.eos, pad_token_id=specials.pad)
    return _strict(Qwen3MoeForCausalLM(hf_cfg), _stacked_expert_state(model), ("lm_head.weight",))


def _stacked_expert_state(model, rename=None) -> dict:
    """The MoE decoder's weights with its experts stacked as HF's MoE models hold them
    (``gate_up_proj`` [E, 2 x width, hidden], ``down_proj`` [E, hidden, width]); ``rename``
    maps other names."""
    state, own = {}, model.state_dict()
    for name, t in own.items():
        t = t.detach().float()
        if name.endswith(".mlp.experts.gate"):  # ours gate, up [E, hidden, w] -> HF gate_up_proj [E, 2w, hidden]
            up = own[name[: -len("gate")] + "up"].detach().float()
            state[name[: -len("gate")] + "gate_up_proj"] = torch.cat([t, up], 2).transpose(1, 2).contiguous()
        elif name.endswith(".mlp.experts.up"):
            continue
        elif name.endswith(".mlp.experts.down"):  # ours [E, w, hidden] -> HF [E, hidden, w]
            state[name[: -len("down")] + "down_proj"] = t.transpose(1, 2).contiguous()
        else:
            state[rename(name) if rename else name] = t
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def hf_dots1(model, specials):
    """The MoE decoder with sigmoid routing and a shared expert as ``Dots1ForCausalLM``
    (transformers' dots.llm1: Qwen3's attention with per-head q/k RMSNorm, DeepSeek-V3's
    MoE): sigmoid scores, top-k, the k weights renormalized (``norm_topk_prob``), one
    group, no score bias, a routed scaling of 1; the shared expert is ``n_shared_experts``
    experts' width wide; dense blocks first (``first_k_dense_replace``); full attention."""
    from transformers import Dots1Config, Dots1ForCausalLM  # here: molds-export --help loads no transformers

    cfg, moe = model.config, model.config.moe
    width = moe.expert_size or cfg.intermediate_size
    if moe.shared_expert_size % width or moe.layer_interval != 1 or moe.capacity_factor:
        raise MoldsError("dots.llm1 (the Hugging Face twin of sigmoid routing with a shared expert) needs the shared "
                         "expert a whole number of experts wide, every block after the dense ones an MoE block, "
                         f"and no capacity: this model has moe_shared_expert_size={moe.shared_expert_size}, "
                         f"moe_expert_size={width}, moe_layer_interval={moe.layer_interval}, "
                         f"moe_capacity_factor={moe.capacity_factor}")
    hf_cfg = Dots1Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=width, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, n_shared_experts=moe.shared_expert_size // width,
        n_routed_experts=moe.num_experts, num_experts_per_tok=moe.top_k, n_group=1, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=1.0, first_k_dense_replace=moe.first_dense_layers,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, attention_bias=False,
        sliding_window=None, tie_word_embeddings=cfg.tie_word_embeddings, hidden_act="silu",
        bos_token_id=specials.bos, eos_token_id=specials.eos, pad_token_id=specials.pad)
    state = _stacked_expert_state(model, lambda n: n.replace(".mlp.shared_expert.", ".mlp.shared_experts."))
    for layer in range(moe.first_dense_layers, cfg.num_layers):  # DeepSeek-V3's selection bias: none here
        state[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"] = torch.zeros(moe.num_experts)
    return _strict(Dots1ForCausalLM(hf_cfg), state, ("lm_head.weight",))


def hf_encoder(model):
    """RobertaForSequenceClassification when the model has property heads (a regression's
    label scale folded into its last layer, so the logits are in the labels' units), else
    RobertaForMaskedLM."""
    from transformers import (  # here: molds-export --help loads no transformers
        RobertaForMaskedLM, RobertaForSequenceClassification,
    )

    cfg = model.config
    if cfg.num_tasks and cfg.num_features:
        raise MoldsError(f"model.molecule_features {cfg.molecule_features}: transformers' "
                         f"RobertaForSequenceClassification reads tokens alone, so no transformers class holds heads "
                         f"that also read {cfg.num_features} molecule features; molds-predict and molds-eval score "
                         f"this checkpoint (fine-tune with --model.molecule_features none for a model to export)")
    if cfg.num_tasks and cfg.pooling != "bos":
        raise MoldsError(f"model.pooling {cfg.pooling}: transformers' RobertaForSequenceClassification reads the "
                         f"first token only, so no stock class holds these heads; molds-predict and molds-eval score "
                         f"this checkpoint (fine-tune with --model.pooling bos for a model to export)")
    state = {k: v.detach().float() for k, v in model.state_dict().items()}
    if cfg.num_tasks:
        wanted = {k[len("mlm."):]: v for k, v in state.items() if k.startswith("mlm.roberta.")}
        wanted.update({k: v for k, v in state.items() if k.startswith("classifier.")})
        if "label_std" in state:  # a regression head: its scale folded into the last layer, logits in label units
            std, mean = state["label_std"], state["label_mean"]
            wanted["classifier.out_proj.weight"] = wanted["classifier.out_proj.weight"] * std[:, None]
            wanted["classifier.out_proj.bias"] = wanted["classifier.out_proj.bias"] * std + mean
        return _strict(RobertaForSequenceClassification(cfg.hf_config()), wanted)
    wanted = {k[len("mlm."):]: v for k, v in state.items() if k.startswith("mlm.")}
    return _strict(RobertaForMaskedLM(cfg.hf_config()), wanted, ("lm_head.decoder.bias",))


def export(checkpoint: str, out: str, manifest_dir: str | None = None, dtype: str = "float32") -> str:
    """Write ``checkpoint`` as a Hugging Face directory ``out``; ``dtype``: the weights'
    (float32 as trained, or bfloat16; never FP8: ``kernels.fp8`` quantizes at use only)."""
    if dtype not in ("float32", "bfloat16"):
        raise MoldsError(f"--dtype {dtype}: float32 or bfloat16")

    loaded = open_checkpoint(checkpoint, manifest_dir, with_tokenizer=False)
    if loaded.family == "decoder":
        hf = hf_decoder(loaded.model, loaded.specials)
        # a decoder trained on marked randomized SMILES: generate() never draws the marker,
        # as molds-sample does not (transformers' SuppressTokensLogitsProcessor)
        forbid = forbidden_tokens(loaded.recipe, loaded.specials)
        if forbid:
            hf.generation_config.suppress_tokens = list(forbid)
    elif loaded.family == "seq2seq":
        hf = hf_bart(loaded.model, loaded.specials)
        # generate() never writes the tokens a target never holds, as molds-predict does not
        hf.generation_config.suppress_tokens = list(forbidden_in_targets(loaded.specials))
    else:
        hf = hf_encoder(loaded.model)
    hf = hf.to(getattr(torch, dtype))
    with atomic_directory(out.rstrip("/")) as tmp:
        hf.save_pretrained(tmp, safe_serialization=True)
        tok_src = loaded.specials.path
        for name in os.listdir(tok_src):
            if os.path.isfile(os.path.join(tok_src, name)):
                shutil.copy(os.path.join(tok_src, name), os.path.join(tmp, name))
        with open(os.path.join(tmp, "molds_lineage.json"), "w", encoding="utf-8") as fh:
            json.dump({**loaded.lineage, "exported_from": os.path.abspath(loaded.checkpoint)}, fh, indent=2)
        with open(os.path.join(tmp, "README.md"), "w", encoding="utf-8") as fh:
            fh.write(model_card(loaded, type(hf).__name__))
    return out


_DECODING = {
    "smiles": "The tokens spell canonical SMILES: `tokenizer.decode(ids, skip_special_tokens=True)` is the "
              "molecule.",
    "selfies": "The tokens spell **SELFIES** (one token per bracket symbol), not SMILES. Decode what "
               "`tokenizer.decode(ids, skip_special_tokens=True)` returns with the `selfies` package: "
               "`selfies.decoder(text)` gives the SMILES (every SELFIES string decodes to a molecule).",
    "safe": "The tokens spell **SAFE** strings (BRICS fragments joined by `.`, each cut bond a ring-closure "
            "digit shared by its two fragments), which RDKit may or may not read as they are. Decode what "
            "`tokenizer.decode(ids, skip_special_tokens=True)` returns with the `safe-mol` package: "
            "`safe.decode(text)` gives the SMILES (None when the fragments do not join).",
}


def model_card(loaded, architecture: str) -> str:
    """The exported directory's README: what the model is and how its output is read."""
    rep = of_manifest(loaded.manifest)
    block = (loaded.manifest.data.get("representation") or {"name": "smiles"}) if loaded.manifest else {"name": "smiles"}
    lines = [f"# {loaded.lineage.get('recipe', {}).get('run', {}).get('name') or 'molds model'}", "",
             f"A chemical language model trained with molds ({architecture}, {loaded.family}), exported from "
             f"`{os.path.abspath(loaded.checkpoint)}` at step {loaded.lineage.get('step')}.", "",
             "## Reading its output", "", _DECODING[rep.name], ""]
    if rep.name != "smiles":
        lines += [f"Representation: `{json.dumps(block, sort_keys=True)}`.", ""]
    pairs = loaded.manifest.pairs if loaded.manifest else None
    if pairs is not None and loaded.family == "decoder":  # a pair model completes a source
        task = pairs.get("task")
        lines += [f"A `{task}` pair model: it completes the prompt `<bos> SOURCE <sep>` with the target and "
                  f"`<eos>` (SOURCE and target: canonical SMILES, molecules sorted, as `molds-preprocess --task "
                  f"{task}` wrote them). This beam search is the one `molds-predict` runs (the special tokens "
                  f"suppressed, as it suppresses them).", "",
                  "```python", "import torch", "from transformers import AutoModelForCausalLM, AutoTokenizer",
                  "tok = AutoTokenizer.from_pretrained(PATH)", "model = AutoModelForCausalLM.from_pretrained(PATH)",
                  "ids = [tok.bos_token_id, *tok(SOURCE, add_special_tokens=False).input_ids, tok.sep_token_id]",
                  "special = [t for t in (tok.bos_token_id, tok.sep_token_id, tok.pad_token_id, tok.mask_token_id, "
                  "tok.unk_token_id) if t is not None]",
                  "out = model.generate(torch.tensor([ids]), num_beams=10, num_return_sequences=10, "
                  "max_new_tokens=200, do_sample=False, suppress_tokens=special)",
                  "targets = [tok.decode(o[len(ids):], skip_special_tokens=True).replace(' ', '') for o in out]",
                  "```", ""]
    elif pairs is not None and loaded.family == "seq2seq":
        task = pairs.get("task")
        lines += [f"A `{task}` encoder-decoder: the encoder reads `<bos> SOURCE <eos>`, the decoder writes the "
                  f"target from `<bos>` to `<eos>` (SOURCE and target: canonical SMILES, molecules sorted, as "
                  f"`molds-preprocess --task {task}` wrote them). `generate` with beams runs the search "
                  f"`molds-predict` runs (the tokens a target never holds are suppressed in the generation config).",
                  "", "```python", "import torch", "from transformers import AutoModelForSeq2SeqLM, AutoTokenizer",
                  "tok = AutoTokenizer.from_pretrained(PATH)", "model = AutoModelForSeq2SeqLM.from_pretrained(PATH)",
                  "ids = [tok.bos_token_id, *tok(SOURCE, add_special_tokens=False).input_ids, tok.eos_token_id]",
                  "out = model.generate(torch.tensor([ids]), num_beams=10, num_return_sequences=10, "
                  "max_new_tokens=200, do_sample=False)",
                  "targets = [tok.decode(o, skip_special_tokens=True).replace(' ', '') for o in out]",
                  "```", ""]
    elif loaded.family == "decoder":
        lines += ["```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
                  "tok = AutoTokenizer.from_pretrained(PATH)", "model = AutoModelForCausalLM.from_pretrained(PATH)",
                  "out = model.generate(tok('', return_tensors='pt').input_ids[:, :1], do_sample=True, max_new_tokens=128)",
                  "text = tok.decode(out[0], skip_special_tokens=True)"]
        if rep.name == "selfies":
            lines += ["import selfies; smiles = selfies.decoder(text)"]
        elif rep.name == "safe":
            lines += ["import safe; smiles = safe.decode(text)"]
        lines += ["```", ""]
    return "\n".join(lines)


def hf_bart(model, specials):
    """The encoder-decoder as transformers' ``BartForConditionalGeneration``, weights copied
    one to one (the layers carry BART's names); decoding starts at ``<bos>``."""
    from transformers import BartConfig, BartForConditionalGeneration  # here: molds-export --help loads no transformers

    cfg = model.config
    hf_cfg = BartConfig(
        vocab_size=cfg.vocab_size, d_model=cfg.hidden_size, encoder_layers=cfg.encoder_layers,
        decoder_layers=cfg.decoder_layers, encoder_attention_heads=cfg.num_heads, decoder_attention_heads=cfg.num_heads,
        encoder_ffn_dim=cfg.intermediate_size, decoder_ffn_dim=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings, activation_function="gelu", dropout=cfg.dropout,
        attention_dropout=0.0, activation_dropout=0.0, scale_embedding=cfg.scale_embedding, tie_word_embeddings=True,
        pad_token_id=specials.pad, bos_token_id=specials.bos, eos_token_id=specials.eos,
        decoder_start_token_id=specials.bos, forced_eos_token_id=None, forced_bos_token_id=None)
    state = {k: v.detach().float() for k, v in model.state_dict().items()}
    for side in ("encoder", "decoder"):  # transformers keeps the shared table under each side too
        state[f"model.{side}.embed_tokens.weight"] = state["model.shared.weight"]
    return _strict(BartForConditionalGeneration(hf_cfg), state)
