// "Try it": the prompt goes to the edge (runners/edge/, in front on the portal's address) as JSON, with the session's CSRF token; the answer's text, or its error, shows below.
(function () {
  "use strict";
  var form = document.querySelector("[data-testid=try-it]");
  if (!form) return;
  var output = document.querySelector("[data-testid=try-output]");
  var meta = document.querySelector("[data-testid=try-meta]");
  var error = document.querySelector("[data-testid=try-error]");
  function number(value) { return /^-?\d+(\.\d+)?$/.test(value.trim()) ? Number(value) : value; }
  function show(element, text) { element.textContent = text; element.hidden = false; }
  function describe(status, data) {
    if (data && typeof data === "object") {
      if (data.detail) return data.detail;
      return Object.keys(data).map(function (field) {
        var why = data[field];
        return field + ": " + (Array.isArray(why) ? why.join(" ") : why);
      }).join("; ");
    }
    return "The endpoint answered HTTP " + status + ".";
  }
  form.addEventListener("submit", function (event) {
    event.preventDefault();
    var button = form.querySelector("button[type=submit]");
    var body = {prompt: form.elements.prompt.value, max_tokens: number(form.elements.max_tokens.value)};
    if (form.elements.deadline_ms.value.trim()) body.deadline_ms = number(form.elements.deadline_ms.value);
    [output, meta, error].forEach(function (element) { element.hidden = true; });
    button.disabled = true;
    fetch(form.action, {
      method: "POST", credentials: "same-origin",
      headers: {"Content-Type": "application/json", "Accept": "application/json",
                "X-CSRFToken": form.elements.csrfmiddlewaretoken.value},
      body: JSON.stringify(body)
    }).then(function (response) {
      return response.text().then(function (text) {
        var data = null;
        try { data = JSON.parse(text); } catch (ignored) { data = null; }
        if (response.ok && data && typeof data.text === "string") {
          show(output, data.text);
          show(meta, data.tokens + " tokens · queued " + Math.round(data.queue_ms) + " ms · computed " + Math.round(data.compute_ms) + " ms");
        } else {
          var retry = response.headers.get("Retry-After");
          show(error, "HTTP " + response.status + ": " + describe(response.status, data) + (retry ? " (retry after " + retry + " s)" : ""));
        }
      });
    }).catch(function (problem) {
      show(error, "The request did not reach the portal: " + problem.message);
    }).finally(function () { button.disabled = false; });
  });
})();
