/** DOM helpers shared by the panel, the dashboard and the compare view. */

/** A new element of `tag` with a class and plain text. */
export function el<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  className: string,
  text?: string
): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  node.className = className;
  if (text !== undefined) {
    node.textContent = text;
  }
  return node;
}

/** A small toolbar button. */
export function button(label: string, title: string, onClick: () => void): HTMLButtonElement {
  const b = el('button', 'jp-Workbench-button jp-mod-styled', label);
  b.title = title;
  b.addEventListener('click', onClick);
  return b;
}
