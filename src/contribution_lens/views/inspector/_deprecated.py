"""The names the inspector's face and its ``payload`` module offered before the inspector was split into
modules: each keeps working from its old place with a ``DeprecationWarning`` naming its new one.

It sits with the inspector (not in the package's `_compat`, which names every layer) so that the
inspector's modules read it without an import that climbs the layers.
"""

_I = "contribution_lens.views.inspector"
INSPECTOR_NAMES: dict[str, str] = {
    **{name: f"{_I}.codecs" for name in ("ATTENTION_CODES", "COSINE_CODES", "CODECS", "COMPACT_CODECS",
                                          "COMPACT_ATTENTION_ERROR", "HALF_MAX", "quantise", "dequantise",
                                          "quantise_attention", "quantise_cosine", "dequantise_attention",
                                          "dequantise_cosine")},
    **{name: f"{_I}.compact" for name in ("cosine_error_bound", "unit_factors", "compact_payload", "unpack_compact",
                                           "decode_compact")},
    **{name: f"{_I}.windows" for name in ("DEFAULT_TOKENS", "Window", "token_window", "window_starts",
                                           "window_start", "token_label")},
    **{name: f"{_I}.payload" for name in ("combine_cells", "kv_groups", "layer_payload")},
    **{name: f"{_I}.compute" for name in ("compute_payloads", "compute_windows")},
    **{name: f"{_I}.steps" for name in ("Steps", "steps_payload")},
    "VIEWS": f"{_I}.subject",
    "view_factors": f"{_I}.figure",
    "hide_sink": "contribution_lens.drawing.plot",
}  # fmt: skip
"""Where each name that the inspector's face or its ``payload`` module offered before the inspector was split
into modules (windows, codecs, compact, payload, compute, steps, subject, figure) lives now."""


def inspector_names(module: str) -> dict[str, tuple[str, str]]:
    """The deprecated names ``module`` (the inspector's face or its ``payload``) forwards, as `_lazy.face` takes them.

    Each is an `INSPECTOR_NAMES` entry defined elsewhere than ``module``; reading it warns with its new place.
    """
    return {name: (f"{home}:{name}", f"use {home}.{name}") for name, home in INSPECTOR_NAMES.items() if home != module}
