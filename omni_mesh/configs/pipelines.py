"""The built-in pipelines: the reference models (tiny-omni, tiny-tts, tiny-image) and the
synthetic pipeline used by benchmarks and scale tests."""

from __future__ import annotations

from omni_mesh.configs.pipeline_spec import OutputKind, PipelineSpec, StageSpec

_REF = "omni_mesh.engines.reference"

TINY_OMNI = PipelineSpec(
    name="tiny-omni",
    description="Omni speech model: thinker (text + hidden states) -> talker -> code2wav.",
    prompt_fields=("seed", "voice", "max_tokens"),
    stages=(
        StageSpec(
            stage_id=0,
            name="thinker",
            engine=f"{_REF}.thinker:ThinkerEngine",
            final_output=OutputKind.TEXT,
        ),
        StageSpec(
            stage_id=1,
            name="talker",
            engine=f"{_REF}.talker:TalkerEngine",
            sources=(0,),
            processor=f"{_REF}.processors:thinker_to_talker",
        ),
        StageSpec(
            stage_id=2,
            name="code2wav",
            engine=f"{_REF}.code2wav:Code2WavEngine",
            sources=(1,),
            processor=f"{_REF}.processors:talker_to_code2wav",
            final_output=OutputKind.AUDIO,
        ),
    ),
)

TINY_TTS = PipelineSpec(
    name="tiny-tts",
    description="Text to speech: talker -> code2wav.",
    prompt_fields=("seed", "voice", "max_tokens"),
    stages=(
        StageSpec(stage_id=0, name="talker", engine=f"{_REF}.talker:TalkerEngine"),
        StageSpec(
            stage_id=1,
            name="code2wav",
            engine=f"{_REF}.code2wav:Code2WavEngine",
            sources=(0,),
            processor=f"{_REF}.processors:talker_to_code2wav",
            final_output=OutputKind.AUDIO,
        ),
    ),
)

TINY_IMAGE = PipelineSpec(
    name="tiny-image",
    description="Image generation: ar (image tokens) -> dit (diffusion denoising) -> PNG.",
    prompt_fields=("seed", "size", "steps"),
    stages=(
        StageSpec(stage_id=0, name="ar", engine=f"{_REF}.ar:ImageArEngine"),
        StageSpec(
            stage_id=1,
            name="dit",
            engine=f"{_REF}.dit:DitEngine",
            sources=(0,),
            processor=f"{_REF}.processors:ar_to_dit",
            final_output=OutputKind.IMAGE,
        ),
    ),
)

_SYN = "omni_mesh.engines.synthetic:SyntheticEngine"
SYNTHETIC = PipelineSpec(
    name="synthetic",
    description="Three synthetic stages (latency model a + b*batch ms, sized output).",
    prompt_fields=("seed",),
    stages=(
        StageSpec(stage_id=0, name="s0", engine=_SYN),
        StageSpec(stage_id=1, name="s1", engine=_SYN, sources=(0,)),
        StageSpec(stage_id=2, name="s2", engine=_SYN, sources=(1,), final_output=OutputKind.DATA),
    ),
)

SYNTHETIC_DIAMOND = PipelineSpec(
    name="synthetic-diamond",
    description="Synthetic branch + join: s0 -> (s1, s2) -> s3; s3 runs once per request.",
    prompt_fields=("seed",),
    stages=(
        StageSpec(stage_id=0, name="s0", engine=_SYN),
        StageSpec(stage_id=1, name="s1", engine=_SYN, sources=(0,)),
        StageSpec(stage_id=2, name="s2", engine=_SYN, sources=(0,)),
        StageSpec(stage_id=3, name="s3", engine=_SYN, sources=(1, 2), final_output=OutputKind.DATA),
    ),
)

# ---- vLLM pipelines (the `vllm` extra): tiny Llamas built offline, see engines/vllm ----------

_VLLM = "omni_mesh.engines.vllm"
TINY_LLM = PipelineSpec(
    name="tiny-llm",
    description="One vLLM stage: a text LLM (tiny Llama by default; engine_args.model).",
    prompt_fields=("seed", "max_tokens"),
    stages=(
        StageSpec(
            stage_id=0,
            name="llm",
            engine=f"{_VLLM}.engine:VllmEngine",
            final_output=OutputKind.TEXT,
        ),
    ),
)

TINY_OMNI_VLLM = PipelineSpec(
    name="tiny-omni-vllm",
    description="Omni speech on vLLM: thinker -> talker (codec vocabulary) -> code2wav.",
    prompt_fields=("seed", "voice", "max_tokens"),
    stages=(
        StageSpec(
            stage_id=0,
            name="thinker",
            engine=f"{_VLLM}.engine:VllmEngine",
            final_output=OutputKind.TEXT,
        ),
        StageSpec(
            stage_id=1,
            name="talker",
            engine=f"{_VLLM}.engine:VllmEngine",
            sources=(0,),
            processor=f"{_VLLM}.processors:thinker_to_talker",
        ),
        StageSpec(
            stage_id=2,
            name="code2wav",
            engine=f"{_REF}.code2wav:Code2WavEngine",
            sources=(1,),
            processor=f"{_VLLM}.processors:talker_to_code2wav",
            final_output=OutputKind.AUDIO,
        ),
    ),
)

# ---- real architectures on transformers: one Hugging Face folder, each stage loads its part ----

_QWEN3_OMNI = "omni_mesh.engines.qwen3_omni"
_CSM = "omni_mesh.engines.csm"
QWEN3_OMNI = PipelineSpec(
    name="qwen3-omni",
    description="Qwen3-Omni-MoE: thinker (text + audio in) -> talker (+ code predictor) -> "
    "code2wav (tiny-qwen3-omni by default; engine_extras.model).",
    prompt_fields=("seed", "voice", "max_tokens"),
    input_audio=True,
    stages=(
        StageSpec(
            stage_id=0,
            name="thinker",
            engine=f"{_QWEN3_OMNI}.thinker:Qwen3OmniThinkerEngine",
            final_output=OutputKind.TEXT,
        ),
        StageSpec(
            stage_id=1,
            name="talker",
            engine=f"{_QWEN3_OMNI}.talker:Qwen3OmniTalkerEngine",
            sources=(0,),
            processor=f"{_QWEN3_OMNI}.processors:thinker_to_talker",
            stream_input=True,
        ),
        StageSpec(
            stage_id=2,
            name="code2wav",
            engine=f"{_QWEN3_OMNI}.code2wav:Qwen3OmniCode2WavEngine",
            sources=(1,),
            processor=f"{_QWEN3_OMNI}.processors:talker_to_code2wav",
            final_output=OutputKind.AUDIO,
        ),
    ),
)

CSM_TTS = PipelineSpec(
    name="csm-tts",
    description="CSM text to speech: talker (backbone + depth decoder) -> code2wav (Mimi "
    "decoder) (tiny-csm by default; engine_extras.model).",
    prompt_fields=("seed", "voice", "max_tokens"),
    stages=(
        StageSpec(stage_id=0, name="talker", engine=f"{_CSM}.talker:CsmTalkerEngine"),
        StageSpec(
            stage_id=1,
            name="code2wav",
            engine=f"{_CSM}.code2wav:CsmCode2WavEngine",
            sources=(0,),
            processor=f"{_CSM}.processors:talker_to_code2wav",
            final_output=OutputKind.AUDIO,
        ),
    ),
)

_GLM_IMAGE = "omni_mesh.engines.glm_image"
GLM_IMAGE = PipelineSpec(
    name="glm-image",
    description="GLM-Image: ar (GlmImageForConditionalGeneration: prior token ids) -> dit (glyph "
    "encoder, GlmImageTransformer2DModel with CFG, FlowMatch-Euler, VAE decode) -> PNG "
    "(tiny-glm-image by default; engine_extras.model).",
    prompt_fields=("seed", "size", "steps", "width", "height", "guidance_scale", "partial_images"),
    stages=(
        StageSpec(stage_id=0, name="ar", engine=f"{_GLM_IMAGE}.ar:GlmImageArEngine"),
        StageSpec(
            stage_id=1,
            name="dit",
            engine=f"{_GLM_IMAGE}.dit:GlmImageDitEngine",
            sources=(0,),
            processor=f"{_GLM_IMAGE}.processors:ar_to_dit",
            final_output=OutputKind.IMAGE,
        ),
    ),
)

#: Registered from the start (omni_mesh.configs.registry), in this order.
BUILTIN_PIPELINES: tuple[PipelineSpec, ...] = (
    TINY_OMNI,
    TINY_TTS,
    TINY_IMAGE,
    SYNTHETIC,
    SYNTHETIC_DIAMOND,
    TINY_LLM,
    TINY_OMNI_VLLM,
    QWEN3_OMNI,
    CSM_TTS,
    GLM_IMAGE,
)
