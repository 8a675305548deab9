// MathJax 2 reads this object as its configuration when mathjax/MathJax.js loads (it is listed
// first in extra_javascript). pymdownx.arithmatex (generic mode) writes each formula as \( \) or
// \[ \] inside an element of class "arithmatex"; only those are typeset, so a "$" or "\(" in prose
// or code stays text. Generic mode, not MathJax script tags: in a script tag "<" stays "&lt;".
window.MathJax = {
  tex2jax: {
    inlineMath: [["\\(", "\\)"]],
    displayMath: [["\\[", "\\]"]],
    processEscapes: false,
    processEnvironments: false,
    processRefs: false,
    ignoreClass: ".*",
    processClass: "arithmatex",
  },
};
