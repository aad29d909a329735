// The partition form's Preview: fetch the server-drawn GPU for the form's fields and show it
// beside the form, without leaving the page; it also redraws a moment after the fields change.
// Without JavaScript the button opens the same fragment as a page of its own.
(function () {
  "use strict";
  var REDRAW_AFTER_MS = 400;
  var latest = 0;
  var timer = null;

  function preview(form) {
    var target = document.querySelector(form.dataset.previewTarget);
    var fields = new URLSearchParams(new FormData(form));
    fields.delete("csrfmiddlewaretoken");
    // Answers can arrive out of order; only the newest request may draw.
    var request = ++latest;
    fetch(form.dataset.previewUrl + "?" + fields.toString(), { credentials: "same-origin" })
      .then(function (response) {
        if (!response.ok) throw new Error("HTTP " + response.status);
        return response.text();
      })
      .then(function (html) { if (request === latest) target.innerHTML = html; })
      .catch(function (error) {
        if (request === latest) target.textContent = "Could not draw the preview (" + error.message + "); try again.";
      });
  }

  document.addEventListener("click", function (event) {
    var button = event.target.closest("[data-preview]");
    if (!button) return;
    event.preventDefault();
    clearTimeout(timer);
    preview(button.form);
  });

  function redrawSoon(event) {
    var form = event.target.form;
    if (!form || !form.dataset.previewUrl || event.target.name === "name") return;
    clearTimeout(timer);
    timer = setTimeout(function () { preview(form); }, REDRAW_AFTER_MS);
  }
  document.addEventListener("input", redrawSoon);
  document.addEventListener("change", redrawSoon);
})();
