// Parses each Mermaid block given on stdin (a JSON list of {where, text}) with Mermaid's own
// parser, the library GitHub renders diagrams with; prints one line per block: "ok <where>" or
// "error <where>: <first line of the parser's message>". Mermaid wants a DOM even to parse, so
// jsdom stands in for the browser.
import { JSDOM } from "jsdom";

const dom = new JSDOM("<!doctype html><html><body></body></html>");
globalThis.window = dom.window;
globalThis.document = dom.window.document;
const { default: mermaid } = await import("mermaid");

let input = "";
for await (const chunk of process.stdin) input += chunk;
let failed = false;
for (const block of JSON.parse(input)) {
  try {
    const parsed = await mermaid.parse(block.text);
    console.log(`ok ${block.where} ${parsed.diagramType}`);
  } catch (error) {
    failed = true;
    console.log(`error ${block.where}: ${String(error.message).split("\n").slice(0, 3).join(" ")}`);
  }
}
process.exit(failed ? 1 : 0);
