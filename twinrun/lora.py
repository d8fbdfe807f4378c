"""LoRA adapters through peft: write one for a network, load a checkpoint onto it, and its content digest.

An adapter checkpoint is a directory as peft writes it (`adapter_config.json` beside
`adapter_model.safetensors`). Loading injects the LoRA layers into the network in place (no
PeftModel wrapper), so every parameter keeps its name under the wrapper's own prefix and the base
layer's weights move to `<layer>.base_layer.*`: the model's COND_PARAM_PATTERNS still match, and
`probe.params=['*lora_*']` selects exactly the adapter's tensors (`train.params` likewise trains them
alone). Every parameter is left trainable: which ones a run probes or trains is its config's to say.

peft is the optional extra `peft` (`pip install 'twinrun[peft]'`); without it only a model that
names an adapter fails, with one line saying how to install it.
"""

import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from twinrun.errors import ConfigError, StoreError
from twinrun.files import atomic_write, make_dir, read_regular

try:  # the optional extra: a model without an adapter never needs it
    import peft
except ImportError:  # pragma: no cover — CI installs the extra
    peft = None

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_NAME = "default"  # peft's own default name: the parameters read `….lora_A.default.weight`
MAX_CONFIG_BYTES = 1024 * 1024  # a LoRA config is a few hundred bytes of JSON
MAX_WEIGHTS_BYTES = 64 * 2**30  # a rank-256 adapter of a 12B network is ~5 GB
# peft's PeftModel.save_pretrained prefixes every key with this; get_peft_model_state_dict of a bare
# network does not. Both spellings load.
PEFT_MODEL_PREFIX = "base_model.model."


def _need_peft(key: str, value) -> None:
    if peft is None:
        raise ConfigError(key, value, "LoRA adapters need peft: pip install 'twinrun[peft]'")


def _digest(files: list[tuple[str, bytes]]) -> str:
    digest = hashlib.sha256()
    for name, data in files:
        digest.update(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()


def adapter_sha256(path: str | Path) -> str:
    """The adapter's content: sha256 over its config's and its weights' bytes, in that order."""
    path = Path(path).expanduser()
    return _digest([(name, read_regular(path / name, limit, "LoRA adapter file"))
                    for name, limit in ((CONFIG_FILE, MAX_CONFIG_BYTES), (WEIGHTS_FILE, MAX_WEIGHTS_BYTES))])


def _read(path: Path, key: str) -> tuple["peft.LoraConfig", dict[str, torch.Tensor], str]:
    """The adapter's LoRA config, tensors and content digest (of the very bytes read), read as untrusted
    input: one line naming the file."""
    if not path.is_dir():
        raise ConfigError(key, str(path), f"is not a directory holding {CONFIG_FILE} and {WEIGHTS_FILE} "
                          "(what peft's save_pretrained writes)")
    try:
        raw_config = read_regular(path / CONFIG_FILE, MAX_CONFIG_BYTES, "LoRA adapter config")
        raw_weights = read_regular(path / WEIGHTS_FILE, MAX_WEIGHTS_BYTES, "LoRA adapter weights")
    except StoreError as err:
        raise ConfigError(key, str(path), str(err)) from None
    try:
        fields = json.loads(raw_config)
        if not isinstance(fields, dict):
            raise TypeError("not a JSON object")
        if fields.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"peft_type {fields['peft_type']!r} is not LORA")
        known = set(peft.LoraConfig.__dataclass_fields__)
        config = peft.LoraConfig(**{k: v for k, v in fields.items() if k in known and k != "peft_type"})
    except (ValueError, TypeError) as err:
        raise ConfigError(key, str(path), f"{CONFIG_FILE} is not a LoRA config ({err})") from None
    try:
        tensors = load(raw_weights)
    except (SafetensorError, ValueError) as err:
        raise ConfigError(key, str(path), f"{WEIGHTS_FILE} is not a safetensors file ({err})") from None
    digest = _digest([(CONFIG_FILE, raw_config), (WEIGHTS_FILE, raw_weights)])
    return config, {k.removeprefix(PEFT_MODEL_PREFIX): v for k, v in tensors.items()}, digest


def load_adapter(net: torch.nn.Module, path: str | Path, key: str = "model.adapter") -> str:
    """Inject the adapter at `path` into `net` in place and load its weights; its content digest.
    Every adapter tensor must land on a LoRA layer of `net` and every LoRA layer must get its tensors."""
    _need_peft(key, str(path))
    config, tensors, digest = _read(Path(path).expanduser(), key)
    try:
        peft.inject_adapter_in_model(config, net, adapter_name=ADAPTER_NAME)
    except ValueError as err:  # target modules that the network does not have
        raise ConfigError(key, str(path), f"does not fit this network ({str(err).splitlines()[0]})") from None
    expected = set(peft.get_peft_model_state_dict(net, adapter_name=ADAPTER_NAME))
    missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or extra:
        parts = [f"{what} {', '.join(names[:2])}{' …' if len(names) > 2 else ''}"
                 for what, names in (("lacks", missing), ("has unknown", extra)) if names]
        raise ConfigError(key, str(path), f"{WEIGHTS_FILE} does not match its config on this network: it "
                          f"{'; '.join(parts)}")
    own = peft.get_peft_model_state_dict(net, adapter_name=ADAPTER_NAME)
    shapes = sorted(k for k in own if tuple(own[k].shape) != tuple(tensors[k].shape))
    if shapes:
        raise ConfigError(key, str(path), f"{WEIGHTS_FILE} has other shapes than its config gives for "
                          f"{', '.join(shapes[:2])}")
    peft.set_peft_model_state_dict(net, tensors, adapter_name=ADAPTER_NAME)
    net.requires_grad_(True)  # peft froze the base: what a run probes or trains is its config's to say
    return digest


def save_adapter(net: torch.nn.Module, path: str | Path) -> str:
    """Write the LoRA adapter injected into `net` as peft lays it out; its content digest."""
    path = make_dir(Path(path).expanduser())
    config = net.peft_config[ADAPTER_NAME]
    fields = config.to_dict()
    fields = {k: sorted(v) if isinstance(v, set) else v for k, v in fields.items()}
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in
               peft.get_peft_model_state_dict(net, adapter_name=ADAPTER_NAME).items()}
    atomic_write(path / CONFIG_FILE, (json.dumps(fields, indent=2, sort_keys=True) + "\n").encode())
    atomic_write(path / WEIGHTS_FILE, save(tensors))
    return adapter_sha256(path)


def new_adapter(net: torch.nn.Module, target_modules: list[str], rank: int = 4, alpha: float = 4.0,
                seed: int = 0, zero_init: bool = True) -> torch.nn.Module:
    """Inject a fresh LoRA adapter into `net` (in place). zero_init: peft's default, lora_B = 0, so the
    adapted network starts as the base network; False draws both factors (an adapter as if trained).
    The draw is seeded by `seed` alone."""
    _need_peft("target_modules", target_modules)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules),
                             init_lora_weights=bool(zero_init))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft.inject_adapter_in_model(config, net, adapter_name=ADAPTER_NAME)
    net.requires_grad_(True)
    return net
