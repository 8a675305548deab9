// @ts-check
// Payload arrays back to numbers, as their codecs say (codecs.py: CODECS, COMPACT_CODECS).
// `dequantise` is pinned to codecs.py's dequantise by the golden test (tests/views/inspector_golden.test.mjs).

/** @typedef {import("./types.js").Codec} Codec */
/** @typedef {import("./types.js").Numbers} Numbers */

/**
 * The bytes of a base64 string.
 * @param {string} b64
 * @returns {ArrayBuffer}
 */
export function bytes(b64) {
  // The browser's own decoder where it has one (a long window's layer is tens of MB of base64).
  const native = /** @type {any} */ (Uint8Array).fromBase64;
  if (native) return native(b64).buffer;
  const text = atob(b64);
  const out = new Uint8Array(text.length);
  for (let i = 0; i < text.length; i++) out[i] = text.charCodeAt(i);
  return out.buffer;
}

/**
 * An IEEE float16 (its 16 bits) as a number: (-1)^s 2^(e-15) (1 + f/1024), subnormals 2^-14 f/1024.
 * @param {number} h
 * @returns {number}
 */
export function half(h) {
  const sign = h & 0x8000 ? -1 : 1;
  const exponent = (h >> 10) & 0x1f;
  const fraction = h & 0x3ff;
  if (exponent === 0) return sign * 2 ** -14 * (fraction / 1024);
  if (exponent === 31) return fraction ? NaN : sign * Infinity;
  return sign * 2 ** (exponent - 15) * (1 + fraction / 1024);
}

/** @type {Float64Array | null} */
let HALVES = null;

/**
 * Every float16's value (`half` of each of the 65536 codes), computed once: a lookup per number, not a call.
 * @returns {Float64Array}
 */
function halves() {
  if (!HALVES) HALVES = Float64Array.from({ length: 65536 }, (_, h) => half(h));
  return HALVES;
}

/**
 * One payload array (base64, or the bytes themselves) back to numbers: sqrt codes (code/L)^2,
 * linear codes (code - offset)/L, float16 and float32 as they are, int8 codes as they are.
 * @param {string | ArrayBuffer} data
 * @param {Codec} codec
 * @returns {Numbers}
 */
export function dequantise(data, codec) {
  const buffer = typeof data === "string" ? bytes(data) : data;
  if (codec.kind === "float32") return new Float32Array(buffer);
  const codes = codec.dtype === "uint8" ? new Uint8Array(buffer) : codec.dtype === "int8" ? new Int8Array(buffer) : new Uint16Array(buffer);
  if (codec.kind === "int8") return /** @type {Int8Array} */ (codes);
  if (codec.kind === "float16") {
    const table = halves();
    const values = new Float64Array(codes.length);
    for (let i = 0; i < codes.length; i++) values[i] = table[codes[i]];
    return values;
  }
  const values = new Float64Array(codes.length);
  const levels = /** @type {number} */ (codec.levels);
  if (codec.kind === "sqrt") {
    for (let i = 0; i < codes.length; i++) {
      const s = codes[i] / levels;
      values[i] = s * s;
    }
  } else if (codec.kind === "linear") {
    const offset = /** @type {number} */ (codec.offset);
    for (let i = 0; i < codes.length; i++) values[i] = (codes[i] - offset) / levels;
  } else {
    throw new Error("unknown codec " + codec.kind);
  }
  return values;
}

/**
 * The explained predictions (steps.py, steps_payload), decoded once: per step its terms per
 * (layer, head) [layer * n_heads + head], per key, and the flow's last-layer shares (or null).
 * @param {import("./types.js").StepsPayload} steps
 * @returns {import("./types.js").Step[]}
 */
export function decodeSteps(steps) {
  /** @type {Codec} */
  const exact = { kind: "float32", dtype: "float32" };
  return steps.steps.map((step) =>
    Object.assign({}, step, {
      heads: dequantise(step.heads, exact),
      keys: dequantise(step.keys, exact),
      rollout: step.rollout ? dequantise(step.rollout, exact) : null,
    }),
  );
}
