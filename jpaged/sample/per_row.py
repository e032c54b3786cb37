"""The per-row sampling options as fields of the classes that carry them to the jitted sampler.

An option is per-row when its `SamplingParams` field declares it (``"per_row"`` metadata, a
`PerRow`; `PER_ROW_OPTIONS` lists them). `per_row_fields` gives a class one field per such option,
named as it: `SamplingBatch` a list of the rows' values, `SamplingTensors` their padded array. So a
new per-row option reaches the sampler without being named anywhere but in its field. Nothing here
imports JAX.
"""
import dataclasses

from jpaged.sampling_params import PER_ROW_OPTIONS


def per_row_fields(annotation, **field_options):
    """Class decorator, applied below ``@dataclass``: a keyword-only field per per-row option, after
    the class's own fields, annotated ``annotation`` and made by ``dataclasses.field(**field_options)``
    (e.g. ``default_factory=list``)."""
    def add(cls):
        annotations = dict(cls.__dict__.get("__annotations__", {}))
        for name in PER_ROW_OPTIONS:
            if name in annotations:
                raise TypeError(f"{cls.__name__}.{name}: a per-row option's field is added by per_row_fields")
            annotations[name] = annotation
            setattr(cls, name, dataclasses.field(kw_only=True, **field_options))
        cls.__annotations__ = annotations
        return cls
    return add
