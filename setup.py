"""hetu_ext: heterogeneous-parallel training (Malleus, Hydraulis, HotSPa, LobRA, Elastor) and FISEdit as a plugin
for Megatron-core and DeepSpeed. The top-level ``patches/`` folder is installed as ``hetu_ext.patches``."""

from setuptools import find_packages, setup

TORCH = "torch==2.13.0"  # the CPU wheel CI has on disk; a looser pin may pull a multi-GB CUDA build

setup(
    name="hetu_ext",
    version="0.1.0",
    description="Heterogeneous-parallel training systems for Megatron-core and DeepSpeed",
    python_requires=">=3.10",
    packages=find_packages(include=["hetu_ext", "hetu_ext.*"]) + ["hetu_ext.patches"],
    package_dir={"hetu_ext.patches": "patches"},
    package_data={"hetu_ext": ["data/samples/*", "diffusion/toy_model/*", "diffusion/toy_model/*/*",
                               "plan/cost/devices/*.yaml"]},
    install_requires=["numpy", "pyyaml>=6", "safetensors>=0.4"],
    extras_require={
        "cpu": [TORCH],
        # sentencepiece: --tokenizer-type Llama2Tokenizer (a SentencePiece model file), as Megatron-LM reads it
        "megatron": [TORCH, "megatron-core==0.16.1", "sentencepiece"],
        "megatron-lm": [TORCH, "megatron-core==0.16.1", "six", "sentencepiece"],  # a Megatron-LM checkout imports six
        "deepspeed": [TORCH, "deepspeed==0.19.8"],
        # scipy: HiGHS MILP references in tests; tensorboard: the metrics test reads the event files back; pytest-xdist:
        # make test runs the fast tier on two workers
        "dev": ["pytest>=8", "pytest-timeout", "pytest-xdist>=3.5", "scipy>=1.9", "tensorboard>=2.14"],
        "diffusion": [TORCH, "diffusers>=0.30", "transformers>=4.40"],
        "plot": ["matplotlib>=3.7"],
        "metrics": ["tensorboard>=2.14"],  # --tensorboard-dir (wandb for --wandb-project is the user's to install)
        "lora": [TORCH, "peft>=0.13", "transformers>=4.40"],  # LobRA: PEFT export of tenants' adapters
    },
    entry_points={"console_scripts": ["hetu-plan=hetu_ext.plan.__main__:main",
                                      "hetu-ckpt=hetu_ext.checkpoint.__main__:main"]},
)
