// A minimal DOM for running the widget modules under node: just what they use.
class Style {
  constructor() { this.props = {}; }
  setProperty(name, value) { this.props[name] = String(value); }
  getPropertyValue(name) { return this.props[name] ?? ""; }
}

class ClassList {
  constructor(node) { this.node = node; }
  get items() { return this.node.className.split(/\s+/).filter(Boolean); }
  contains(c) { return this.items.includes(c); }
  add(c) { if (!this.contains(c)) this.node.className = [...this.items, c].join(" "); }
  remove(c) { this.node.className = this.items.filter((x) => x !== c).join(" "); }
  toggle(c, on) {
    const want = on === undefined ? !this.contains(c) : on;
    if (want) this.add(c); else this.remove(c);
    return want;
  }
}

export class Node {
  constructor(tag, text = null) {
    this.tagName = tag.toUpperCase();
    this.children = [];
    this.parent = null;
    this.attributes = {};
    this.listeners = {};
    this.className = "";
    this.style = new Style();
    this.classList = new ClassList(this);
    this.text = text;
    this.value = "";
  }
  appendChild(child) {
    if (child.parent) child.parent.children = child.parent.children.filter((c) => c !== child);
    child.parent = this;
    this.children.push(child);
    return child;
  }
  append(...kids) { for (const k of kids) this.appendChild(typeof k === "string" ? new Node("#text", k) : k); }
  replaceChildren(...kids) {
    for (const c of this.children) c.parent = null;
    this.children = [];
    this.append(...kids);
  }
  setAttribute(name, value) {
    this.attributes[name] = String(value);
    if (name === "value") this.value = String(value);
  }
  getAttribute(name) { return this.attributes[name] ?? null; }
  addEventListener(type, fn) { (this.listeners[type] ||= []).push(fn); }
  removeEventListener(type, fn) { this.listeners[type] = (this.listeners[type] || []).filter((f) => f !== fn); }
  dispatch(type, event = {}) { for (const fn of this.listeners[type] || []) fn({ target: this, clientX: 5, clientY: 5, ...event }); }
  getBoundingClientRect() { return { left: 0, top: 0, width: 800, height: 600 }; }
  set textContent(v) { this.children = []; this.text = String(v); }
  get textContent() { return (this.text ?? "") + this.children.map((c) => c.textContent).join(""); }
}

export function installDom() {
  globalThis.document = {
    createElement: (tag) => new Node(tag),
    createElementNS: (_ns, tag) => new Node(tag),
    createTextNode: (text) => new Node("#text", text),
  };
}

/** Every node under root (depth first), root included. */
export function walk(root, out = []) {
  out.push(root);
  for (const c of root.children) walk(c, out);
  return out;
}

export function byClass(root, cls) { return walk(root).filter((n) => n.classList.contains(cls)); }

/** An anywidget-like model: get/set/save_changes/on/off/send, change events on set;
 * emit(event, ...args) calls the handlers of an event (e.g. "msg:custom"). */
export function fakeModel(state) {
  const handlers = {};
  const saved = [];
  const sent = [];
  return {
    state,
    saved,
    sent,
    get: (k) => state[k],
    set(k, v) { state[k] = v; for (const fn of handlers[`change:${k}`] || []) fn(); },
    save_changes() { saved.push(JSON.parse(JSON.stringify(state))); },
    send(msg) { sent.push(msg); },
    emit(ev, ...args) { for (const fn of handlers[ev] || []) fn(...args); },
    on(ev, fn) { (handlers[ev] ||= []).push(fn); },
    off(ev, fn) { handlers[ev] = (handlers[ev] || []).filter((f) => f !== fn); },
    handlers,
  };
}
