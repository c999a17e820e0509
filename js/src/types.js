// @ts-check
/**
 * Types shared by the panels (JSDoc only; this module exports nothing at run time).
 *
 * @typedef {{
 *   get(name: string): any,
 *   set(name: string, value: any): void,
 *   save_changes(): void,
 *   on(event: string, cb: () => void): void,
 *   off(event?: string | null, cb?: (() => void) | null): void,
 * }} Model
 * @typedef {[string, string, string?]} Choice  value, short label, long label (the tooltip)
 * @typedef {{ el: HTMLElement, view: any, token: number, pending: Promise<void> | null }} ChartSlot
 * @typedef {{
 *   model: Model, el: HTMLElement, root: HTMLElement, id: string,
 *   send: (name: string, value: any) => void,
 *   on: (event: string, cb: () => void) => void,
 *   setLocalError: (field: string, message: string) => void,
 * }} Ctx  what every panel gets: the model, the host element, the widget root, a unique id,
 *         send (set one trait and save) and on (subscribe; unsubscribed when the view goes);
 *         setLocalError: an input the frontend refused (named in the banner; "" clears it)
 */
export {};
