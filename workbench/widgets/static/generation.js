// Generation view: each row's prompt (muted) and the text the model has written so far.
import { el } from "./common.js";

function render({ model, el: host }) {
  const root = el("div", { class: "wb-widget wb-generation" });
  host.appendChild(root);
  function draw() {
    const texts = model.get("texts") || [];
    const prompts = model.get("prompts") || [];
    const state = model.get("state");
    const rate = model.get("tokens_per_s");
    const facts = [state, `${model.get("tokens")} new tokens`,
      typeof rate === "number" ? `${rate.toPrecision(3)} tokens/s` : null];
    const rows = (texts.length ? texts : prompts).map((text, i) => {
      const prompt = prompts[i] || "";
      const cut = text.startsWith(prompt) ? prompt.length : 0;
      return el("pre", { class: "wb-generation-row" }, [
        el("span", { class: "wb-generation-prompt", text: text.slice(0, cut) }),
        el("span", { class: "wb-generation-new", text: text.slice(cut) }),
        state === "generating" ? el("span", { class: "wb-generation-cursor", text: "▍" }) : null,
      ]);
    });
    root.replaceChildren(
      el("div", { class: "wb-header" }, [
        el("span", { class: "wb-title", text: "generate" }),
        el("span", { class: "wb-facts", text: facts.filter((x) => x).join(" · ") }),
      ]),
      ...rows,
    );
  }
  draw();
  const names = ["texts", "prompts", "state", "tokens", "tokens_per_s"];
  for (const n of names) model.on(`change:${n}`, draw);
  return () => { for (const n of names) model.off(`change:${n}`, draw); };
}

export default { render };
