"""Model classes of this package, for what stock DeepSeek checkpoints cannot express.

`MixtralMLAForCausalLM`: DeepSeek-V3's MLA attention (the converter's output, absorb included) with
Mixtral's own sparse MoE MLP (softmax over the experts, top-k, renormalised; experts carried exactly).
No stock transformers class does both: DeepSeek-V3's router scores with a sigmoid, and transformers'
DeepSeek-V2 router never renormalises the top-k weights and always adds shared experts.

Importing this module registers the classes with transformers' Auto classes (no remote code):

    import transmla.models  # noqa: F401
    model = AutoModelForCausalLM.from_pretrained(converted_dir)

`load_model` (transmla.io.sources) imports it, so every loader of this package reads such exports.
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import AutoConfig, AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock


@strict
class MixtralMLAConfig(DeepseekV3Config):
    """DeepseekV3Config (MLA shapes, every layer's MLP replaced) + Mixtral's MoE fields:
    num_local_experts (= n_routed_experts), num_experts_per_tok, intermediate_size (per expert)."""

    model_type = "transmla_mixtral_mla"
    router_jitter_noise: float = 0.0


class MixtralMLAForCausalLM(DeepseekV3ForCausalLM):
    """DeepseekV3ForCausalLM whose decoder layers use MixtralSparseMoeBlock as their MLP. State dict
    names: DeepSeek-V3's for attention and norms, Mixtral's (transformers 5) for the MoE:
    model.layers.{i}.mlp.gate.weight [E, D], .mlp.experts.gate_up_proj [E, 2I, D], .mlp.experts.down_proj [E, D, I]."""

    config_class = MixtralMLAConfig

    def __init__(self, config: MixtralMLAConfig):
        super().__init__(config)
        for layer in self.model.layers:
            layer.mlp = MixtralSparseMoeBlock(config)
        self.post_init()


AutoConfig.register(MixtralMLAConfig.model_type, MixtralMLAConfig, exist_ok=True)
AutoModelForCausalLM.register(MixtralMLAConfig, MixtralMLAForCausalLM, exist_ok=True)


def causal_lm_class(config):
    """The class that loads a converted checkpoint's config: stock DeepseekV3ForCausalLM unless the
    original's MLP needs one of this module's classes."""
    return MixtralMLAForCausalLM if isinstance(config, MixtralMLAConfig) else DeepseekV3ForCausalLM
