// @ts-check
// The view state's settings as the Python side describes them (state.py's SETTINGS, sent in every meta as
// `settings`): their names, defaults, which ones a page's URL fragment names, and the toggles. The front-end
// keeps no list of its own: a setting added in Python is a trait, a link entry and (a boolean) a toggle here.

/** @typedef {import("./types.js").Meta} Meta */
/** @typedef {import("./types.js").Setting} Setting */

/**
 * Every setting's name, in the table's order: the widget's traits that make a view (what a still records).
 * @param {Meta | null} meta
 * @returns {string[]}
 */
export function settingNames(meta) {
  return ((meta && meta.settings) || []).map((setting) => setting.name);
}

/**
 * The settings a page's URL fragment names: always, or where they are not the default.
 * @param {Meta} meta
 * @returns {Setting[]}
 */
export function linkedSettings(meta) {
  return (meta.settings || []).filter((setting) => setting.link !== "never");
}

/**
 * The settings drawn as toggles, one checkbox each: the boolean ones, with their labels.
 * @param {Meta | null} meta
 * @returns {Setting[]}
 */
export function toggleSettings(meta) {
  return ((meta && meta.settings) || []).filter((setting) => setting.type === "bool");
}

/**
 * A setting's value as a URL fragment writes it: a boolean as 1 or 0, anything else as its text.
 * @param {Setting} setting
 * @param {unknown} value
 * @returns {string}
 */
export function linkValue(setting, value) {
  return setting.type === "bool" ? (value ? "1" : "0") : String(value);
}
