"""Samplers: each a frozen dataclass of its hyper-parameters sharing one denoising loop.

How to write a sampler, a logit transform, an exit rule and a cache: ``docs/writing-samplers.md``.
"""

from dllm.engine import compat
from dllm.samplers import registry
from dllm.samplers.adablock import AdaBlock
from dllm.samplers.bacd import BACD
from dllm.samplers.base import Sampler
from dllm.samplers.cad import CAD
from dllm.samplers.ccd import CCD
from dllm.samplers.compose import Composed, ExitRule
from dllm.samplers.confidence import Factor, LLaDA, Threshold
from dllm.samplers.credit import Credit, CreditFusion
from dllm.samplers.dcd import DCD
from dllm.samplers.dream import Dream
from dllm.samplers.eb import EB
from dllm.samplers.entropy_threshold import EntropyThreshold
from dllm.samplers.eotp import EoTP
from dllm.samplers.ete import ETE
from dllm.samplers.fast_dllm_v2 import FastDLLMv2
from dllm.samplers.freedave import FreeDave
from dllm.samplers.learn2pd import Learn2PD
from dllm.samplers.llada2 import LLaDA2, LLaDA21
from dllm.samplers.localleap import LocalLeap
from dllm.samplers.prophet import Prophet
from dllm.samplers.registry import defaults, get, names, reference, register
from dllm.samplers.s2d2 import S2D2
from dllm.samplers.sched import SchED
from dllm.samplers.sdar import SDAR
from dllm.samplers.transforms import Transform
from dllm.samplers.wedlm import WeDLM

# generate()'s advice on a transformers argument names the sampler whose hyper-parameter it is
compat.advise(Sampler.generate, lambda key: [n for n in names() if not registry.is_part(n) and key in defaults(n)])

__all__ = [
    "Sampler",
    "ExitRule",
    "Transform",
    "Composed",
    "LLaDA",
    "Dream",
    "CCD",
    "DCD",
    "Learn2PD",
    "EoTP",
    "SDAR",
    "FastDLLMv2",
    "LLaDA2",
    "LLaDA21",
    "S2D2",
    "Threshold",
    "Factor",
    "EB",
    "EntropyThreshold",
    "BACD",
    "CAD",
    "FreeDave",
    "Credit",
    "CreditFusion",
    "ETE",
    "LocalLeap",
    "AdaBlock",
    "Prophet",
    "SchED",
    "WeDLM",
    "get",
    "names",
    "defaults",
    "reference",
    "register",
]
