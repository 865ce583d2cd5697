// Exercise widget: prompt, answer box, check button; the kernel checks the answer with JAX.
// State lives in traitlets (answer, status, explanation, hint, attempts); this view only
// displays it and sends {type: "check", answer} when the learner asks for a check.
import { el } from "./common.js";

/** Prompt text: paragraphs, with lines indented by 4 spaces shown as code. */
function promptNode(text) {
  const box = el("div", { class: "wb-ex-prompt" });
  for (const line of text.split("\n")) {
    if (line.startsWith("    ")) box.appendChild(el("pre", { class: "wb-ex-code", text: line.slice(4) }));
    else if (line.trim()) box.appendChild(el("p", { text: line }));
  }
  return box;
}

const LABELS = {
  "": "",
  checking: "checking with JAX…",
  correct: "✓ correct",
  wrong: "✗ not yet",
  error: "error while checking",
};

function render({ model, el: root }) {
  const input = el("input", {
    class: "wb-ex-input",
    type: "text",
    spellcheck: "false",
    "aria-label": "your answer",
    placeholder: model.get("placeholder"),
  });
  input.value = model.get("answer");
  const submit = () => {
    model.set("answer", input.value);
    model.save_changes();
    model.set("status", "checking");
    draw();
    model.send({ type: "check", answer: input.value });
  };
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter") { event.preventDefault(); submit(); }
  });
  const button = el("button", { class: "wb-ex-check", type: "button", onclick: submit }, ["Check"]);
  const verdict = el("div", { class: "wb-ex-verdict", role: "status", "aria-live": "polite" });
  const explanation = el("div", { class: "wb-ex-explanation" });
  const hint = el("div", { class: "wb-ex-hint" });
  const header = el("div", { class: "wb-ex-title" }, [
    el("span", { class: "wb-ex-tag", text: "exercise" }),
    ` ${model.get("title")} `,
    el("code", { class: "wb-ex-name", text: model.get("name") }),
  ]);
  const card = el("div", { class: "wb-widget wb-exercise" }, [
    header,
    promptNode(model.get("prompt")),
    el("div", { class: "wb-ex-row" }, [input, button]),
    verdict, explanation, hint,
  ]);
  root.appendChild(card);

  function draw() {
    const status = model.get("status");
    card.setAttribute("data-status", status);
    button.disabled = status === "checking";
    const attempts = model.get("attempts");
    verdict.textContent = LABELS[status] ?? status;
    if (status === "wrong" && attempts > 1) verdict.textContent += ` (attempt ${attempts})`;
    const showText = status === "correct" || status === "wrong" || status === "error";
    explanation.textContent = showText ? model.get("explanation") : "";
    const h = model.get("hint");
    hint.textContent = status === "wrong" && h ? `hint: ${h}` : "";
  }
  const syncAnswer = () => {
    if (globalThis.document?.activeElement !== input) input.value = model.get("answer");
  };
  const handlers = [["change:answer", syncAnswer],
    ...["status", "explanation", "hint", "attempts"].map((key) => [`change:${key}`, draw])];
  for (const [event, fn] of handlers) model.on(event, fn);
  draw();
  return () => { for (const [event, fn] of handlers) model.off(event, fn); };
}

export default { render };
