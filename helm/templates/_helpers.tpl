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

{{/* Values a schema cannot express: refused with a message that names them. */}}
{{- define "specdec.validate" -}}
{{- $v := .Values -}}
{{- $g := int (include "specdec.gpusPerReplica" .) -}}
{{- if eq $v.backend "embedded" -}}
{{- if gt $g 1 -}}{{- fail (printf "parallelism: tensor x pipeline = %d, but the embedded backend runs on one device; use backend sglang or tensorrt-llm" $g) -}}{{- end -}}
{{- else -}}
{{- if eq $v.engine.source "demo" -}}{{- fail (printf "engine.source=demo is the CPU image's demo engine; backend %s needs engine.source build or prebuilt" $v.backend) -}}{{- end -}}
{{- if and (gt $g (int $v.gpu.perNode)) (ne (mod $g (int $v.gpu.perNode)) 0) -}}{{- fail (printf "parallelism: %d GPUs per replica do not fit nodes of gpu.perNode=%d (use a multiple of it, or fewer than it)" $g (int $v.gpu.perNode)) -}}{{- end -}}
{{- if and (lt $g (int $v.gpu.perNode)) (ne (mod (int $v.gpu.perNode) $g) 0) -}}{{- fail (printf "parallelism: %d GPUs per replica do not divide the %d GPUs of a node (gpu.perNode), so %d of each node's GPUs could never be used; choose tensor x pipeline dividing it" $g (int $v.gpu.perNode) (mod (int $v.gpu.perNode) $g)) -}}{{- end -}}
{{- if and (eq $v.engine.source "prebuilt") (not $v.engine.cache.existingClaim) -}}{{- fail (printf "engine.source=prebuilt on backend %s needs engine.cache.existingClaim: the PVC holding the engine, mounted at /engine-cache (engine.path inside it); without one the pod would look for %s in the image" $v.backend $v.engine.path) -}}{{- end -}}
{{- if and (eq $v.backend "tensorrt-llm") (gt $g (int $v.gpu.perNode)) -}}{{- fail "multi-node TensorRT-LLM needs MPI orchestration this chart does not provide; use backend sglang for replicas spanning nodes" -}}{{- end -}}
{{- end -}}
{{- if eq $v.engine.source "build" -}}
{{- if and (eq $v.model.source "pvc") (not $v.model.pvc.claimName) -}}{{- fail "engine.source=build with model.source=pvc needs model.pvc.claimName" -}}{{- end -}}
{{- if and (eq $v.model.source "huggingface") (or (not $v.model.huggingface.target) (not $v.model.huggingface.draft)) -}}{{- fail "model.source=huggingface needs model.huggingface.target and model.huggingface.draft" -}}{{- end -}}
{{- if and (eq $v.model.source "s3") (or (not $v.model.s3.target) (not $v.model.s3.draft)) -}}{{- fail "model.source=s3 needs model.s3.target and model.s3.draft" -}}{{- end -}}
{{- end -}}
{{- /* The builder's own table (export/engine_rules.py, generated into files/engine-rules.yaml): layouts an engine refuses. */ -}}
{{- range (.Files.Get "files/engine-rules.yaml" | fromYaml).rules -}}
{{- if and (eq .backend $v.backend) (has $v.engine.draft .drafts) (or (ne .when "pipeline") (gt (int $v.parallelism.pipeline) 1)) -}}
{{- fail (printf "backend %s with draft %s%s: %s" $v.backend $v.engine.draft (ternary (printf " and parallelism.pipeline=%d" (int $v.parallelism.pipeline)) "" (eq .when "pipeline")) .reason) -}}
{{- end -}}
{{- end -}}
{{- if and (eq $v.engine.source "prebuilt") $v.engine.cache.existingClaim (not (hasPrefix "/engine-cache/" $v.engine.path)) -}}{{- fail (printf "engine.path %s: a prebuilt engine on engine.cache.existingClaim is mounted at /engine-cache; give its path there (/engine-cache/...)" $v.engine.path) -}}{{- end -}}
{{- if and $v.autoscaling.enabled (eq $v.autoscaling.mode "keda") (not $v.monitoring.serviceMonitor.enabled) -}}{{- fail "autoscaling.mode=keda queries Prometheus for the queue metric of this release's Service (the service label), which exists only when the ServiceMonitor scrapes it: set monitoring.serviceMonitor.enabled=true, or KEDA would read nothing and scale on 0" -}}{{- end -}}
{{- if gt (int $v.autoscaling.minReplicas) (int $v.autoscaling.maxReplicas) -}}{{- fail (printf "autoscaling: minReplicas %d exceeds maxReplicas %d" (int $v.autoscaling.minReplicas) (int $v.autoscaling.maxReplicas)) -}}{{- end -}}
{{- if and $v.apiKey.existingSecret (eq $v.backend "tensorrt-llm") -}}{{- fail "apiKey.existingSecret: trtllm-serve takes no API key, so the key would not be checked; put an authenticating gateway in front (and leave apiKey empty), or use backend sglang or embedded" -}}{{- end -}}
{{- if and $v.router.enabled (ne $v.backend "sglang") -}}{{- fail "router.enabled: the SGLang Model Gateway routes SGLang workers; use backend sglang (or a Service for the others)" -}}{{- end -}}
{{- end -}}

{{- define "specdec.image" -}}
{{- $img := index .Values.images .Values.backend -}}
{{ printf "%s:%s" $img.repository $img.tag }}
{{- end -}}

{{/* The engine directory the server starts from. A built engine is cached under a key that says what it is for:
     draft, backend, parallelism, GPU type, kit version and a hash of the model source, tree, dtype and build
     arguments, so changed inputs build a new engine instead of colliding with the old one. */}}
{{- define "specdec.engineKey" -}}
{{- $e := .Values.engine -}}
{{- $inputs := dict "model" .Values.model "tree" $e.tree "totalTokens" $e.totalTokens "depth" $e.depth "topK" $e.topK "dtype" $e.dtype "buildArgs" $e.buildArgs -}}
{{- printf "%s-%s-tp%d-pp%d-%s-%s-%s" $e.draft .Values.backend (int .Values.parallelism.tensor) (int .Values.parallelism.pipeline) .Values.gpu.product .Chart.AppVersion (toJson $inputs | sha256sum | trunc 12) | lower -}}
{{- end -}}
{{- define "specdec.enginePath" -}}
{{- if eq .Values.engine.source "build" -}}/engine-cache/{{ include "specdec.engineKey" . }}{{- else -}}{{ .Values.engine.path }}{{- end -}}
{{- end -}}
{{- define "specdec.engineClaim" -}}
{{- default (printf "%s-engine-cache" (include "specdec.fullname" .)) .Values.engine.cache.existingClaim -}}
{{- end -}}

{{- define "specdec.healthPaths" -}}
{{- if eq .Values.backend "sglang" -}}{"live": "/health", "ready": "/health_generate", "metrics": "/metrics"}
{{- else if eq .Values.backend "tensorrt-llm" -}}{"live": "/health", "ready": "/health", "metrics": "/prometheus/metrics"}
{{- else -}}{"live": "/health", "ready": "/health/ready", "metrics": "/metrics"}{{- end -}}
{{- end -}}

{{- define "specdec.queueMetric" -}}
{{- if .Values.autoscaling.queueMetric -}}{{ .Values.autoscaling.queueMetric }}
{{- else if eq .Values.backend "sglang" -}}sglang:num_queue_reqs
{{- else if eq .Values.backend "tensorrt-llm" -}}trtllm_num_requests_waiting
{{- else -}}specdec:num_requests_waiting{{- end -}}
{{- end -}}
