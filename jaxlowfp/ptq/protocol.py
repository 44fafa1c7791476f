"""The export protocol: what `jaxlowfp.ptq.export` and `jaxlowfp.ptq.export_gguf` ask a model
(`jaxlowfp._core.export_spec`, where it is defined so that `jaxlowfp.models` implements it without importing
`jaxlowfp.ptq`)."""
from jaxlowfp._core.export_spec import TARGETS, Exportable, ExportTensor, require_exportable

__all__ = ["TARGETS", "ExportTensor", "Exportable", "require_exportable"]
