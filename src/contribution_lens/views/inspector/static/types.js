// @ts-check
// The shapes the inspector's front-end reads and keeps, for the type checker (JSDoc only: no code).
// The payload is written by the Python side (views/inspector/payload.py, compact.py, steps.py);
// the host is the anywidget model's adapter (inspector.js) or the static page's (page.js).

/**
 * How one array is coded (codecs.py, CODECS and COMPACT_CODECS).
 * @typedef {object} Codec
 * @property {"sqrt" | "linear" | "float32" | "float16" | "int8"} kind
 * @property {"uint16" | "uint8" | "int8" | "float16" | "float32"} dtype
 * @property {number} [levels] codes per unit (sqrt and linear)
 * @property {number} [offset] the code of 0 (linear)
 */

/** @typedef {Array<[number, string]>} Colorscale plotly's: [[t, "rgb(r, g, b)" or "#rrggbb"], ...], t in [0, 1] */

/**
 * One setting of the view state as the Python side describes it (state.py, schema): the front-end's one list.
 * @typedef {object} Setting
 * @property {string} name
 * @property {"int" | "str" | "bool"} type a "bool" setting is a toggle
 * @property {number | string | boolean} default the widget's value before anything is chosen
 * @property {"always" | "changed" | "never"} link whether a page's URL fragment names it: always, off its default, never
 * @property {string} label a toggle's text
 * @property {boolean} offered whether its control is shown (KV grouping: only where heads share a value head)
 */

/**
 * The view a page or widget opens on, and what the host holds as the current view (its properties are
 * the settings of meta.settings; a test checks both lists agree).
 * @typedef {object} State
 * @property {number} layer
 * @property {number | "all"} head
 * @property {string} factor
 * @property {string} scope
 * @property {number} query
 * @property {string} [view] "heatmap", "text" or "prediction"
 * @property {number} [start] the token window's first query (the widget's)
 * @property {number} [tokens] the token window's queries (the widget's)
 * @property {boolean} [hide_sink]
 * @property {boolean} [group_kv]
 * @property {number} [step] the explained step (-1: none)
 */

/**
 * What a page needs besides the layers' numbers (payload.py, meta).
 * @typedef {object} Meta
 * @property {number[]} queries positions of the token window's queries
 * @property {number[]} keys positions of its keys (the queries, and the sink 0 when the window starts later)
 * @property {string[]} query_labels "position:token"
 * @property {string[]} key_labels
 * @property {number[][]} outside the keys outside the window, as runs [first, last] (empty when none)
 * @property {boolean} causal a causal model's query sees keys up to itself only
 * @property {number} n_heads
 * @property {number[][]} kv_groups the query heads of each value head
 * @property {number} n_tokens the text's length
 * @property {number[]} layers
 * @property {State} initial
 * @property {Setting[]} settings the view state's settings (state.py, schema)
 * @property {string} key the window's name, "first-last"
 * @property {string[]} factors
 * @property {string[]} signed the factors drawn on a diverging scale
 * @property {string[]} scopes
 * @property {Record<string, Codec>} codecs
 * @property {boolean} compact
 * @property {{diverging: Colorscale, sequential: Colorscale}} colorscales
 * @property {string[]} [head_labels]
 */

/**
 * One layer of a fine page or of the widget (payload.py, window_payload): each array base64 in its codec.
 * @typedef {{[name: string]: any, codecs: Record<string, string>, kv_groups: number[][], key: string,
 *            layer?: number}} FinePayload
 */

/**
 * One layer of a compact page (compact.py, compact_payload): one zlib stream, inflated into `buffer`.
 * @typedef {object} CompactPayload
 * @property {string} packed base64 of the deflated stream
 * @property {Record<string, [string, number, number]>} layout each array's codec, byte offset and length
 * @property {number} d_head
 * @property {number[][]} kv_groups
 * @property {string} key
 * @property {ArrayBuffer} [buffer] the inflated stream (`inflate`)
 */

/** @typedef {FinePayload | CompactPayload} Payload */

/** @typedef {Float64Array | Float32Array | Int8Array} Numbers one decoded array */

/** @typedef {Record<string, Numbers>} Arrays a layer's decoded arrays, by payload name */

/**
 * A decoded layer: its arrays and where each (query, key) cell lives in them.
 * @typedef {object} Decoded
 * @property {Int32Array} index [query * n_keys + key] -> cell, -1 where not displayable
 * @property {number} cells
 * @property {number} H heads
 * @property {Arrays} arrays
 */

/**
 * The four factors of one view, per cell.
 * @typedef {{attention: Numbers, relative_norm: Numbers, cosine: Numbers, contribution: Numbers}} Factors
 */

/** @typedef {{intra: Factors, inter: Factors}} BothScopes */

/** @typedef {{attention: Float64Array, contribution: Float64Array}} Outside per query, the view's share on keys outside the window */

/**
 * One explained step as sent (steps.py, steps_payload).
 * @typedef {object} SentStep
 * @property {number} position
 * @property {string} token
 * @property {string} quantity e.g. "logit(' Paris')"
 * @property {number} logit what the parts add up to: the float readout of the model's residual stream
 * @property {number | null} model_value the value the model computed in its own dtype (null: not recorded)
 * @property {{attention: number, mlp: number, embedding: number, biases: number, rounding: number}} parts
 *   rounding: a half-precision model's rounding of its attention outputs (0 in float32)
 * @property {string} heads base64 float32 [layer * n_heads + head]
 * @property {string} keys base64 float32 [key]
 * @property {string | null} rollout base64 float32 [key], the flow's last-layer shares
 */

/**
 * @typedef {object} StepsPayload
 * @property {string[]} labels every token's label
 * @property {number} n_layers
 * @property {number} n_heads
 * @property {SentStep[]} steps
 */

/**
 * One explained step, decoded.
 * @typedef {Omit<SentStep, "heads" | "keys" | "rollout"> &
 *           {heads: Numbers, keys: Numbers, rollout: Numbers | null}} Step
 */

/** @typedef {{about: StepsPayload, steps: Step[]}} Steps */

/**
 * What the view asks of its host: the static page (page.js) or the widget's model (inspector.js).
 * @typedef {object} Host
 * @property {() => Meta | null} meta
 * @property {(layer: number) => Payload | null} layer the layer's payload, null while it is not here
 * @property {() => State} state
 * @property {(partial: Partial<State>) => void} set
 * @property {() => Array<[number, number]>} [windows] the token windows offered: [first, last] queries
 * @property {() => string} [error] why the last change was refused ("" when it was not)
 * @property {(state: State | null) => string} [pending] what to say while a layer is not here
 * @property {() => StepsPayload | null} [steps]
 * @property {(step: number, layer: number, head: number) => void} [open] a head clicked in the prediction view
 * @property {() => PanelSpec[]} [panels] the registered panels (panel.py, specs)
 * @property {(spec: PanelSpec, request: Record<string, number>, ask: boolean) => PanelAnswer} [panel] a panel's data
 *   for a request, or why there is none (the widget asks its kernel where `ask`; the page reads what it carries)
 */

/**
 * A registered panel as a front-end loads it (panel.py, specs).
 * @typedef {object} PanelSpec
 * @property {string} name
 * @property {string} title
 * @property {string[]} on the settings its request names (layer, head, query)
 * @property {string} script its ES module's source, exporting draw(element, context)
 */

/**
 * What a host answers for a panel's request: exactly one of these is set.
 * @typedef {object} PanelAnswer
 * @property {any} [data] the data the panel's compute returned
 * @property {string} [error] why the kernel could not compute it
 * @property {boolean} [pending] asked: the kernel computes it
 * @property {boolean} [unasked] not asked (ask was false) and not here
 * @property {boolean} [gone] no kernel answered
 * @property {number[]} [missing] the page does not carry it; the queries it carries for this panel
 */

/**
 * What a panel's draw(element, context) is given.
 * @typedef {object} PanelContext
 * @property {string} name
 * @property {string} title
 * @property {State} state the view drawn
 * @property {Meta} meta the window's meta (labels, layers)
 * @property {Record<string, number>} request the settings the panel names, for this state
 * @property {{query: number, key: number} | null} selected the clicked cell, where its query is the state's
 * @property {number} width the width the view is drawn for, px
 * @property {Record<string, any>} memo the panel's own notes, kept until the next click on the heatmap
 * @property {(ask?: boolean) => PanelAnswer} answer the request's data (ask: false asks no kernel for it)
 * @property {(partial: Partial<State>) => void} set change the view, as the menus do
 * @property {() => Promise<unknown>} redraw draw everything again
 * @property {(node: HTMLElement, traces: any[], layout: any, onClick?: (event: any) => void) => Promise<unknown>} plot
 *   plotly's drawing as the inspector's figures use it
 * @property {(x: number) => string} fmt a number as the inspector writes it (4 significant digits)
 */

/**
 * The anywidget model, as render() uses it.
 * @typedef {object} WidgetModel
 * @property {(name: string) => any} get
 * @property {(name: string, value: any) => void} set
 * @property {(event: string, callback: (message?: any) => void) => void} on
 * @property {(event: string, callback: (message?: any) => void) => void} off
 * @property {(message: Record<string, any>) => void} send
 * @property {() => void} save_changes
 * @property {any} [widget_manager] the front-end's widget manager (JupyterLab's holds its notebook: `context`)
 */

/**
 * @typedef {object} Parts
 * @property {Record<string, HTMLSelectElement>} controls the menus, by name
 * @property {Record<string, HTMLInputElement>} toggles the checkboxes, by setting
 * @property {HTMLElement} status what the inspector waits for
 * @property {HTMLElement} problem why a change was refused
 * @property {HTMLElement} flow the text view
 * @property {HTMLElement} heatmap
 * @property {HTMLElement} bars the selected query's factors
 * @property {HTMLElement} panels the registered panels' elements
 * @property {HTMLElement} prediction the prediction view: caption, heads, key text
 * @property {HTMLElement} predictionCaption
 * @property {HTMLElement} heads
 * @property {HTMLElement} keyText
 */

/**
 * A decoded layer, and what was derived from it per view (factors, hover text), kept while the layer is.
 * @typedef {{d: Decoded, views: Map<string, any>}} Entry
 */

/**
 * One inspector's drawing: its elements, its host, what it drew last.
 * @typedef {object} View
 * @property {HTMLElement} root the element the inspector lives in
 * @property {Parts} parts
 * @property {Host} host
 * @property {Map<string, Entry>} cache the last few layers decoded, by window and layer
 * @property {[StepsPayload, Step[]] | null} decodedSteps the steps payload and its decoding, decoded once
 * @property {{queries: number[], qLabels: string[], keys?: number[], kLabels?: string[]} | null} current what
 *   the last drawing showed: the click handlers read it, never a stale window
 * @property {number} drawnWidth the width the figures were drawn for
 * @property {number} [heatmapWidth] the heatmap's width in it (all of it, or what the bars beside it leave)
 * @property {number} [barsWidth] the bars' width (beside the heatmap, or under it)
 * @property {((qi: number, ki: number) => string) | null} [hoverAt] the hover text of a cell of the drawn heatmap
 * @property {{query: number, key: number} | null} [selected] the cell last clicked (marked while its query is shown)
 * @property {boolean} [reveal] the bars come into view once drawn (after a click)
 * @property {() => Promise<unknown>} [redraw] everything drawn again from the host (what mount's refresh does)
 * @property {Array<{spec: PanelSpec, module: {draw: (element: HTMLElement, context: PanelContext) => unknown}}>}
 *   [panels] the panels' loaded modules
 * @property {Record<string, Record<string, any>>} [panelMemo] each panel's notes, by name, until the next click
 */

export {};
