{{/* Names and labels */}}
{{- define "specdec.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "specdec.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "specdec.labels" -}}
{{ include "specdec.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
specdec.io/backend: {{ .Values.backend }}
{{- end -}}

{{/* `helm test` pods: the release's labels but none that the Service, the router's discovery or an InferencePool
     select, so no live traffic is ever routed to them. */}}
{{- define "specdec.testLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}-test
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: test
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Every serving pod's annotations (single, leader and worker): the engine it serves, and podAnnotations (a Multus
     network, a sidecar's settings). */}}
{{- define "specdec.podAnnotations" -}}
annotations:
  specdec.io/engine: {{ include "specdec.enginePath" . | quote }}
  {{- with .Values.podAnnotations }}{{ toYaml . | nindent 2 }}{{- end }}
{{- end -}}

{{/* The rolling update's surge and unavailability: the values', or per backend (GPU: no spare GPUs assumed). */}}
{{- define "specdec.rollout" -}}
{{- $gpu := eq (include "specdec.gpuBackend" .) "true" -}}
{{- $r := .Values.rollout -}}
maxSurge: {{ ternary (ternary 0 1 $gpu) $r.maxSurge (kindIs "invalid" $r.maxSurge) }}
maxUnavailable: {{ ternary (ternary 1 0 $gpu) $r.maxUnavailable (kindIs "invalid" $r.maxUnavailable) }}
{{- end -}}

{{/* The Grafana dashboard in the backend's own metrics: each query's series renamed (files/dashboard-metrics.yaml),
     a query reading a series the engine does not have left out, and a panel left with no query dropped. */}}
{{- define "specdec.dashboard" -}}
{{- $dashboard := .Files.Get "files/dashboard.json" | fromJson -}}
{{- $names := index (.Files.Get "files/dashboard-metrics.yaml" | fromYaml) .Values.backend | default dict -}}
{{- $panels := list -}}
{{- range $dashboard.panels -}}
{{- $targets := list -}}
{{- range .targets -}}
{{- $expr := .expr -}}
{{- $kept := true -}}
{{- range regexFindAll "specdec:[a-z_]+" .expr -1 -}}
{{- if hasKey $names . -}}
{{- $name := index $names . -}}
{{- if $name -}}{{- $expr = replace . $name $expr -}}{{- else -}}{{- $kept = false -}}{{- end -}}
{{- end -}}
{{- end -}}
{{- if $kept -}}{{- $targets = append $targets (set (deepCopy .) "expr" $expr) -}}{{- end -}}
{{- end -}}
{{- if $targets -}}{{- $panels = append $panels (set (deepCopy .) "targets" $targets) -}}{{- end -}}
{{- end -}}
{{- toPrettyJson (set $dashboard "panels" $panels) -}}
{{- end -}}

{{/* A component's placement (the router's, the endpoint picker's): its nodeSelector, tolerations and affinity, and
     the release's priorityClassName. */}}
{{- define "specdec.placement" -}}
{{- $c := .component -}}
{{- with .root.Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $c.nodeSelector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $c.tolerations }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $c.affinity }}
affinity: {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "specdec.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}{{ default (include "specdec.fullname" .) .Values.serviceAccount.name }}{{- else -}}{{ default "default" .Values.serviceAccount.name }}{{- end -}}
{{- end -}}

{{/* Parallelism: GPUs per replica = TP x PP; replicas needing more GPUs than a node has span nodes (LeaderWorkerSet). */}}
{{- define "specdec.gpuBackend" -}}{{ ne .Values.backend "embedded" }}{{- end -}}
{{- define "specdec.gpusPerReplica" -}}{{ mul (int .Values.parallelism.tensor) (int .Values.parallelism.pipeline) }}{{- end -}}
{{- define "specdec.nodesPerReplica" -}}
{{- $g := int (include "specdec.gpusPerReplica" .) -}}{{- $n := int .Values.gpu.perNode -}}
{{- if gt $g $n -}}{{ div $g $n }}{{- else -}}1{{- end -}}
{{- end -}}
{{- define "specdec.gpusPerPod" -}}
{{- $g := int (include "specdec.gpusPerReplica" .) -}}{{- $n := int .Values.gpu.perNode -}}
{{- if gt $g $n -}}{{ $n }}{{- else -}}{{ $g }}{{- end -}}
{{- end -}}
{{- define "specdec.multiNode" -}}{{ gt (int (include "specdec.nodesPerReplica" .)) 1 }}{{- end -}}

{{/* Refuse the values with a message naming them. `fail` stops helm install, upgrade and template; helm lint renders
     with `fail` switched off (it logs the message at INFO and goes on), so an include of a template that cannot exist
     follows, which lint reports as an error carrying the same message: lint is a gate too. */}}
{{- define "specdec.refuse" -}}
{{- fail . -}}
{{- include (printf "values refused: %s" .) dict -}}
{{- end -}}

{{/* The custom resources the values turn on whose API the cluster does not serve, one message each (a JSON list).
     `helm template` and client-side dry runs see no cluster's APIs (unless given --api-versions), so they list every
     one: NOTES.txt warns of them, and only apiCheck=require refuses an install or upgrade over them (helm lint,
     which is neither, is never refused). */}}
{{- define "specdec.missingApis" -}}
{{- $v := .Values -}}
{{- $wanted := list -}}
{{- if eq (include "specdec.multiNode" .) "true" -}}{{- $wanted = append $wanted (dict "what" (printf "parallelism: %d GPUs per replica over %s nodes" (int (include "specdec.gpusPerReplica" .)) (include "specdec.nodesPerReplica" .)) "kind" "LeaderWorkerSet" "api" "leaderworkerset.x-k8s.io/v1" "provider" "the LeaderWorkerSet controller (kubernetes-sigs/lws)") -}}{{- end -}}
{{- if $v.autoscaling.enabled -}}
{{- if eq $v.autoscaling.mode "keda" -}}{{- $wanted = append $wanted (dict "what" "autoscaling.mode=keda" "kind" "ScaledObject" "api" "keda.sh/v1alpha1" "provider" "KEDA") -}}
{{- else -}}{{- $wanted = append $wanted (dict "what" "autoscaling.mode=prometheus-adapter" "kind" "HorizontalPodAutoscaler on a pods metric" "api" "custom.metrics.k8s.io/v1beta1" "provider" "prometheus-adapter (it serves the custom metrics API)") -}}{{- end -}}
{{- end -}}
{{- if $v.monitoring.serviceMonitor.enabled -}}{{- $wanted = append $wanted (dict "what" "monitoring.serviceMonitor.enabled" "kind" "ServiceMonitor" "api" "monitoring.coreos.com/v1" "provider" "the Prometheus Operator (e.g. kube-prometheus-stack)") -}}{{- end -}}
{{- if $v.monitoring.podMonitor.enabled -}}{{- $wanted = append $wanted (dict "what" "monitoring.podMonitor.enabled" "kind" "PodMonitor" "api" "monitoring.coreos.com/v1" "provider" "the Prometheus Operator (e.g. kube-prometheus-stack)") -}}{{- end -}}
{{- if $v.httpRoute.enabled -}}{{- $wanted = append $wanted (dict "what" "httpRoute.enabled" "kind" "HTTPRoute" "api" "gateway.networking.k8s.io/v1" "provider" "the Gateway API CRDs and a Gateway implementation") -}}{{- end -}}
{{- if $v.inferencePool.enabled -}}{{- $wanted = append $wanted (dict "what" "inferencePool.enabled" "kind" "InferencePool" "api" "inference.networking.k8s.io/v1" "provider" "the Gateway API Inference Extension CRDs and a Gateway that supports them") -}}{{- end -}}
{{- $missing := list -}}
{{- range $wanted -}}
{{- if not ($.Capabilities.APIVersions.Has .api) -}}
{{- $missing = append $missing (printf "%s renders a %s (%s), but the cluster serves no %s API: install %s first (helm template: pass --api-versions %s)" .what .kind .api .api .provider .api) -}}
{{- end -}}
{{- end -}}
{{- toJson $missing -}}
{{- end -}}

{{/* Values a schema cannot express: refused with a message that names them. */}}
{{- define "specdec.validate" -}}
{{- $v := .Values -}}
{{- $g := int (include "specdec.gpusPerReplica" .) -}}
{{- $n := int $v.gpu.perNode -}}
{{- if eq $v.backend "embedded" -}}
{{- if gt $g 1 -}}{{- include "specdec.refuse" (printf "parallelism: tensor x pipeline = %d, but the embedded backend runs on one device; use backend sglang, vllm or tensorrt-llm" $g) -}}{{- end -}}
{{- else -}}
{{- if eq $v.engine.source "demo" -}}{{- include "specdec.refuse" (printf "engine.source=demo is the CPU image's demo engine; backend %s needs engine.source build or prebuilt" $v.backend) -}}{{- end -}}
{{- if and (gt $g $n) (ne (mod $g $n) 0) -}}{{- include "specdec.refuse" (printf "parallelism: %d GPUs per replica do not fit nodes of gpu.perNode=%d (use a multiple of it, or fewer than it)" $g $n) -}}{{- end -}}
{{- if and (lt $g $n) (ne (mod $n $g) 0) -}}{{- include "specdec.refuse" (printf "parallelism: %d GPUs per replica do not divide the %d GPUs of a node (gpu.perNode), so %d of each node's GPUs could never be used; choose tensor x pipeline dividing it" $g $n (mod $n $g)) -}}{{- end -}}
{{- if and (eq $v.engine.source "prebuilt") (not $v.engine.cache.existingClaim) -}}{{- include "specdec.refuse" (printf "engine.source=prebuilt on backend %s needs engine.cache.existingClaim: the PVC holding the engine, mounted at /engine-cache (engine.path inside it); without one the pod would look for %s in the image" $v.backend $v.engine.path) -}}{{- end -}}
{{- if and (eq $v.backend "tensorrt-llm") (gt $g $n) -}}{{- include "specdec.refuse" "multi-node TensorRT-LLM needs MPI orchestration this chart does not provide; use backend sglang or vllm for replicas spanning nodes" -}}{{- end -}}
{{- end -}}
{{- if eq $v.engine.source "build" -}}
{{- if and (eq $v.model.source "pvc") (not $v.model.pvc.claimName) -}}{{- include "specdec.refuse" "engine.source=build with model.source=pvc needs model.pvc.claimName" -}}{{- end -}}
{{- $head := eq (include "specdec.hasHead" .) "true" -}}
{{- if and (eq $v.model.source "huggingface") (or (not $v.model.huggingface.target) (and $head (not $v.model.huggingface.draft))) -}}{{- include "specdec.refuse" (printf "model.source=huggingface needs model.huggingface.target%s" (ternary " and model.huggingface.draft" "" $head)) -}}{{- end -}}
{{- if and (eq $v.model.source "s3") (or (not $v.model.s3.target) (and $head (not $v.model.s3.draft))) -}}{{- include "specdec.refuse" (printf "model.source=s3 needs model.s3.target%s" (ternary " and model.s3.draft" "" $head)) -}}{{- end -}}
{{- end -}}
{{- /* The builder's own table (export/engine_rules.py, generated into files/engine-rules.yaml): layouts an engine refuses. */ -}}
{{- range (.Files.Get "files/engine-rules.yaml" | fromYaml).rules -}}
{{- if and (eq .backend $v.backend) (has $v.engine.draft .drafts) (or (ne .when "pipeline") (gt (int $v.parallelism.pipeline) 1)) -}}
{{- include "specdec.refuse" (printf "backend %s with draft %s%s: %s" $v.backend $v.engine.draft (ternary (printf " and parallelism.pipeline=%d" (int $v.parallelism.pipeline)) "" (eq .when "pipeline")) .reason) -}}
{{- end -}}
{{- end -}}
{{- if and (eq $v.engine.source "prebuilt") $v.engine.cache.existingClaim (not (hasPrefix "/engine-cache/" $v.engine.path)) -}}{{- include "specdec.refuse" (printf "engine.path %s: a prebuilt engine on engine.cache.existingClaim is mounted at /engine-cache; give its path there (/engine-cache/...)" $v.engine.path) -}}{{- end -}}
{{- if and $v.autoscaling.enabled (eq $v.autoscaling.mode "keda") (not $v.monitoring.serviceMonitor.enabled) (not $v.monitoring.podMonitor.enabled) -}}{{- include "specdec.refuse" "autoscaling.mode=keda queries Prometheus for the queue metric of this release's servers, which Prometheus has only when this chart's ServiceMonitor or PodMonitor scrapes them: set monitoring.serviceMonitor.enabled=true or monitoring.podMonitor.enabled=true, or KEDA would read nothing and scale on 0" -}}{{- end -}}
{{- /* Trees the engines refuse, as the builder refuses them (export/servers/sglang.py, export/trtllm_pytorch.py). */ -}}
{{- $e := $v.engine -}}
{{- if and (ne $e.tree "dynamic") (or (eq $v.backend "sglang") (not (eq (include "specdec.hasHead" .) "true"))) -}}
{{- include "specdec.refuse" (printf "engine.tree %s: %s drafts dynamic trees only (steps / top-k / draft tokens); use engine.tree: dynamic" $e.tree (ternary "SGLang" (printf "draft %s" $e.draft) (eq $v.backend "sglang"))) -}}
{{- end -}}
{{- if eq $e.tree "dynamic" -}}
{{- $candidates := add (int $e.topK) (mul (int $e.depth) (int $e.topK) (int $e.topK)) -}}
{{- if gt (sub (int $e.totalTokens) 1) $candidates -}}
{{- include "specdec.refuse" (printf "engine.totalTokens=%d exceeds the %d candidates that depth=%d, topK=%d produce (+1 root)" (int $e.totalTokens) $candidates (int $e.depth) (int $e.topK)) -}}
{{- end -}}
{{- end -}}
{{- if and (eq $v.backend "tensorrt-llm") (eq $e.tree "dynamic") -}}
{{- $levels := add (int $e.depth) 1 -}}{{- $total := sub (int $e.totalTokens) 1 -}}
{{- if or (lt $total $levels) (gt $total (mul (int $e.topK) $levels)) -}}
{{- include "specdec.refuse" (printf "engine tree dynamic:%d:%d:%d: TensorRT-LLM needs max_draft_len (%d) <= max_total_draft_tokens (%d) <= dynamic_tree_max_topK * max_draft_len (%d); choose engine.totalTokens within that" (int $e.totalTokens) (int $e.depth) (int $e.topK) $levels $total (mul (int $e.topK) $levels)) -}}
{{- end -}}
{{- end -}}
{{- $rollout := include "specdec.rollout" . | fromYaml -}}
{{- if and (eq (toString $rollout.maxSurge) "0") (eq (toString $rollout.maxUnavailable) "0") -}}{{- include "specdec.refuse" "rollout: maxSurge and maxUnavailable are both 0, so an update could never replace a replica; allow a surge (GPUs to spare) or an unavailable replica" -}}{{- end -}}
{{- if gt (int $v.autoscaling.minReplicas) (int $v.autoscaling.maxReplicas) -}}{{- include "specdec.refuse" (printf "autoscaling: minReplicas %d exceeds maxReplicas %d" (int $v.autoscaling.minReplicas) (int $v.autoscaling.maxReplicas)) -}}{{- end -}}
{{- if and $v.apiKey.existingSecret (eq $v.backend "tensorrt-llm") -}}{{- include "specdec.refuse" "apiKey.existingSecret: trtllm-serve takes no API key, so the key would not be checked; put an authenticating gateway in front (and leave apiKey empty), or use backend sglang, vllm or embedded" -}}{{- end -}}
{{- if and (eq $v.backend "tensorrt-llm") (contains "/" (include "specdec.servedModelName" .)) -}}{{- include "specdec.refuse" (printf "server.servedModelName %s: trtllm-serve names its model after the model directory, so the name cannot hold a '/'" (include "specdec.servedModelName" .)) -}}{{- end -}}
{{- if and $v.router.enabled (ne $v.backend "sglang") -}}{{- include "specdec.refuse" "router.enabled: the SGLang Model Gateway routes SGLang workers; use backend sglang (or a Service, or inferencePool, for the others)" -}}{{- end -}}
{{- if and $v.router.enabled $v.inferencePool.enabled -}}{{- include "specdec.refuse" "router.enabled and inferencePool.enabled: both pick the replica for each request; choose one" -}}{{- end -}}
{{- if and (eq $v.apiCheck "require") (or .Release.IsInstall .Release.IsUpgrade) -}}
{{- range (include "specdec.missingApis" . | fromJsonArray) -}}{{- include "specdec.refuse" (printf "%s (apiCheck=require; the default, warn, renders and warns)" .) -}}{{- end -}}
{{- end -}}
{{- end -}}

{{- define "specdec.image" -}}
{{- $img := index .Values.images .Values.backend -}}
{{ printf "%s:%s" $img.repository $img.tag }}
{{- end -}}

{{/* Whether engine.draft reads a draft checkpoint: every kind but the model-free ones (ngram, suffix) alone. */}}
{{- define "specdec.hasHead" -}}{{ not (has .Values.engine.draft (list "ngram" "suffix")) }}{{- end -}}

{{- define "specdec.servedModelName" -}}{{ default (include "specdec.fullname" .) .Values.server.servedModelName }}{{- end -}}

{{/* Where the build reads the checkpoints: inside model.pvc's claim, or the model cache the Job downloads into (one
     directory per source, so another repository or bucket never mixes with a cached one). */}}
{{- define "specdec.modelPaths" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "pvc" -}}{"target": {{ printf "/models/%s" $m.pvc.target | quote }}, "draft": {{ printf "/models/%s" $m.pvc.draft | quote }}}
{{- else if eq $m.source "huggingface" -}}{"target": {{ printf "/models/hf/%s" $m.huggingface.target | quote }}, "draft": {{ printf "/models/hf/%s" $m.huggingface.draft | quote }}}
{{- else -}}{"target": {{ printf "/models/s3/%s" (trimPrefix "s3://" $m.s3.target | trimSuffix "/") | quote }}, "draft": {{ printf "/models/s3/%s" (trimPrefix "s3://" $m.s3.draft | trimSuffix "/") | quote }}}{{- end -}}
{{- end -}}

{{/* The engine directory the server starts from. A built engine is cached under a key that says what it is for:
     draft, backend, parallelism, GPU type, kit version and a hash of what identifies the checkpoints (their source and
     where in it), the tree, dtype and build arguments, so changed inputs build a new engine instead of colliding with
     the old one, and settings that change nothing built (cache sizes, storage classes) leave it alone. */}}
{{- define "specdec.engineKey" -}}
{{- $e := .Values.engine -}}
{{- $m := .Values.model -}}
{{- $where := ternary (pick $m.pvc "claimName" "target" "draft") (pick (index $m $m.source) "target" "draft") (eq $m.source "pvc") -}}
{{- $inputs := dict "model" (dict "source" $m.source "where" $where) "tree" $e.tree "totalTokens" $e.totalTokens "depth" $e.depth "topK" $e.topK "dtype" $e.dtype "buildArgs" $e.buildArgs -}}
{{- printf "%s-%s-tp%d-pp%d-%s-%s-%s" $e.draft .Values.backend (int .Values.parallelism.tensor) (int .Values.parallelism.pipeline) .Values.gpu.product .Chart.AppVersion (toJson $inputs | sha256sum | trunc 12) | lower -}}
{{- end -}}
{{- define "specdec.enginePath" -}}
{{- if eq .Values.engine.source "build" -}}/engine-cache/{{ include "specdec.engineKey" . }}{{- else -}}{{ .Values.engine.path }}{{- end -}}
{{- end -}}
{{- define "specdec.engineClaim" -}}
{{- default (printf "%s-engine-cache" (include "specdec.fullname" .)) .Values.engine.cache.existingClaim -}}
{{- end -}}
{{- define "specdec.modelClaim" -}}
{{- if eq .Values.model.source "pvc" -}}{{ .Values.model.pvc.claimName }}
{{- else -}}{{ default (printf "%s-model-cache" (include "specdec.fullname" .)) .Values.model.cache.existingClaim }}{{- end -}}
{{- end -}}

{{/* Per backend: probes, metrics, the queue depth autoscaling reads, and how `helm test` sees speculation. */}}
{{- define "specdec.healthPaths" -}}
{{- if eq .Values.backend "sglang" -}}{"live": "/health", "ready": "/health_generate", "metrics": "/metrics"}
{{- else if eq .Values.backend "tensorrt-llm" -}}{"live": "/health", "ready": "/health_generate", "metrics": "/prometheus/metrics"}
{{- else if eq .Values.backend "vllm" -}}{"live": "/health", "ready": "/health", "metrics": "/metrics"}
{{- else -}}{"live": "/health", "ready": "/health/ready", "metrics": "/metrics"}{{- end -}}
{{- end -}}

{{- define "specdec.queueMetric" -}}
{{- if .Values.autoscaling.queueMetric -}}{{ .Values.autoscaling.queueMetric }}
{{- else if eq .Values.backend "sglang" -}}sglang:num_queue_reqs
{{- else if eq .Values.backend "tensorrt-llm" -}}trtllm_num_requests_waiting
{{- else if eq .Values.backend "vllm" -}}vllm:num_requests_waiting
{{- else -}}specdec:num_requests_waiting{{- end -}}
{{- end -}}

{{/* What shows that the server speculates: /server_info naming the draft (the kit's server and SGLang), and the
     acceptance length, a gauge or (vLLM) 1 + accepted draft tokens / drafts from its counters. */}}
{{- define "specdec.speculationCheck" -}}
{{- $metrics := (include "specdec.healthPaths" . | fromJson).metrics -}}
{{- if eq .Values.backend "sglang" -}}{"info": "/server_info", "metrics": {{ $metrics | quote }}, "gauge": "sglang:spec_accept_length"}
{{- else if eq .Values.backend "tensorrt-llm" -}}{"info": "", "metrics": {{ $metrics | quote }}, "gauge": "trtllm_spec_decode_acceptance_length"}
{{- else if eq .Values.backend "vllm" -}}{"info": "", "metrics": {{ $metrics | quote }}, "accepted": "vllm:spec_decode_num_accepted_tokens_total", "drafts": "vllm:spec_decode_num_drafts_total"}
{{- else -}}{"info": "/server_info", "metrics": {{ $metrics | quote }}, "gauge": "specdec:spec_accept_length"}{{- end -}}
{{- end -}}

{{/* The endpoint picker's name for the backend's engine: vLLM, SGLang and trtllm-serve are built into it; the kit's
     own server is described by its metrics (the picker has no LoRA or cache-geometry series to read from it). */}}
{{- define "specdec.eppEngine" -}}
{{- if eq .Values.backend "vllm" -}}{"name": "vllm"}
{{- else if eq .Values.backend "sglang" -}}{"name": "sglang"}
{{- else if eq .Values.backend "tensorrt-llm" -}}{"name": "trtllm-serve"}
{{- else -}}{"name": "specdec", "config": {"name": "specdec", "queuedRequestsSpec": "specdec:num_requests_waiting", "runningRequestsSpec": "specdec:num_requests_running", "kvUsageSpec": "specdec:kv_cache_usage_perc", "loraSpec": "", "cacheInfoSpec": ""}}{{- end -}}
{{- end -}}

{{- define "specdec.eppConfig" -}}
{{- $engine := include "specdec.eppEngine" . | fromJson -}}
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: metrics-data-source
  parameters:
    path: {{ (include "specdec.healthPaths" . | fromJson).metrics }}
- type: core-metrics-extractor
  parameters:
    defaultEngine: {{ $engine.name }}
    {{- if $engine.config }}
    engineConfigs:
    - {{ $engine.config | toJson }}
    {{- end }}
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
dataLayer:
  sources:
  - pluginRef: metrics-data-source
    extractors:
    - pluginRef: core-metrics-extractor
{{- end -}}
