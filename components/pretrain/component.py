"""kfp wrapper of the pretrain step (see ``step.py`` for the logic and ``README.md`` for usage).

kfp reads a lightweight component's parameters from its function's signature and ships the function's
*source* to the container, so the signature must exist as source text. It is generated here from the
one declaration, :class:`components.pretrain.settings.PretrainSettings` (name, type, default and the
docstring of every field), compiled, and registered in :mod:`linecache` under a pseudo file name, where
``inspect.getsource`` (and so kfp) finds it.
"""

import dataclasses
import linecache
from typing import Optional

from kfp import dsl
from kfp.dsl import Dataset, Input, Metrics, Model, Output

from components import default_image
from components.pretrain.settings import parameter_docs, settings_fields

#: The artifacts of the step, with their descriptions.
ARTIFACTS = {
    "dataset": ("Input[Dataset]", "The preprocess step's manifest (its ``prefix`` becomes ``--data-path``)."),
    "model": ("Output[Model]", "Manifest of the final checkpoint (on the shared volume); metadata: iterations, "
              "tokens_seen, final losses, checkpoint_dir, job."),
    "metrics": ("Output[Metrics]", "final_train_loss, final_valid_loss, tokens_per_s, mfu, tflops_per_device, "
                "iterations."),
}

_BODY = '''
    values = dict(locals())
    from components.pretrain.step import metric_values, run_pretrain, settings_from_kwargs

    summary = run_pretrain(settings_from_kwargs(values), dataset.path, model.path)
    model.metadata.update({key: value for key, value in summary.items() if key != "config"})
    for name, value in metric_values(summary).items():
        metrics.log_metric(name, value)
'''


def component_source() -> str:
    """The source of the ``pretrain`` component function (deterministic: the compiled YAML embeds it)."""
    params = [f"{name}: {kind}" for name, (kind, _) in ARTIFACTS.items()]
    docs = [f"        {name}: {doc}" for name, (_, doc) in ARTIFACTS.items()]
    described = parameter_docs()
    for f in settings_fields():
        params.append(f"{f.name}: {f.type}" + ("" if f.default is dataclasses.MISSING else f" = {f.default!r}"))
        docs.append(f"        {f.name}: {described[f.name]}")
    doc = ('    """Trains a GPT model with a distributed ``domino pretrain`` job (PyTorchJob, or local processes).'
           "\n\n    Args:\n" + "\n".join(docs) + '\n    """')
    return "def pretrain(\n" + "".join(f"    {p},\n" for p in params) + "):\n" + doc + _BODY


def _define():
    source = component_source()
    filename = "<components/pretrain/component.py: generated from PretrainSettings>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"__name__": __name__, "Input": Input, "Output": Output, "Dataset": Dataset, "Model": Model,
                 "Metrics": Metrics}
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - our own generated definition
    return namespace["pretrain"]


pretrain = _define()


def build(image: Optional[str] = None):
    """The pretrain component running in ``image`` (default: :func:`components.default_image`)."""
    return dsl.component(pretrain, base_image=image or default_image(), install_kfp_package=False)
